"""Schemas of the kind applications send, shared by chapter 11, the benchmark and the tests."""

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "New York"]}}}

WEATHER_CALL = {"type": "object", "additionalProperties": False, "required": ["location", "unit"],
                "properties": {"location": {"type": "string", "maxLength": 32},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 14}}}

# Ten properties of every supported kind: the index-build figure of the benchmark.
TEN_PROPERTIES = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "title", "price", "in_stock", "tags", "rating", "category", "sku", "owner", "notes"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "maxLength": 40},
        "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "category": {"type": "string", "enum": ["book", "music", "film", "game"]},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "owner": {"type": "object", "additionalProperties": False, "required": ["name"],
                  "properties": {"name": {"type": "string", "maxLength": 20},
                                 "email": {"type": ["string", "null"], "maxLength": 40}}},
        "notes": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
    },
}

SCHEMAS = {"person": PERSON, "weather_call": WEATHER_CALL, "ten_properties": TEN_PROPERTIES}
PROMPTS = {"person": "Invent a person. Answer in JSON with name, age and city.",
           "weather_call": "What's the weather in Paris for the next 3 days? Answer with the call arguments as JSON.",
           "ten_properties": "Describe a product from an online shop as JSON."}
