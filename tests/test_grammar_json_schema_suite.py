"""JSON Schema -> grammar against the official JSON Schema Test Suite, jsonschema the oracle.

For every case of the shipped files (tests/data/json_schema_test_suite/README.md) the schema is
compiled and each instance's JSON text - json.dumps with the compact and the default separators,
its object keys in some order (the grammar writes properties in the schema's order, so each
order is tried) - must be accepted byte by byte when jsonschema says the instance is valid, and
rejected when it says invalid. Where the suite's own verdict and jsonschema's differ (formats
jsonschema checks loosely) the instance is left out: there is no oracle.

Where the constraint is knowingly not exact (json_grammar.py's docstring), the test says so:
    oneOf        compiled as anyOf: an invalid instance that anyOf accepts may be accepted
    subset       integers are not written as "1.0"; formats time, date-time (no leap second) and
                 email (local@domain only) leave some valid strings out: valid ones are not asserted
A refused schema must be refused with SchemaError; an "unsatisfiable" refusal must be true
(jsonschema rejects all its instances), any other must name a keyword we list as unsupported.
For not, if/then/else and uniqueItems every refusal is listed below with its reason, and a
listed case that compiles fails the test too. uniqueItems is checked at run time (unique_items.py),
so instances are matched with the pushdown automaton and that check together.
"""
import itertools
import json
from pathlib import Path

import jsonschema
import pytest

from minillm.generation.constrained.budget import ConstraintTooLarge
from minillm.generation.constrained.json_grammar import Unsatisfiable, schema_to_grammar
from minillm.generation.constrained.json_schema import SchemaError
from minillm.generation.constrained.pushdown import Pushdown
from minillm.generation.constrained.unique_items import Uniqueness

SUITE = Path(__file__).parent / "data" / "json_schema_test_suite"
VALIDATORS = {"draft2020-12": ("2020-12", jsonschema.Draft202012Validator), "draft7": ("7", jsonschema.Draft7Validator),
              "draft4": ("4", jsonschema.Draft4Validator)}
FILES = sorted(str(p.relative_to(SUITE)) for p in SUITE.rglob("*.json"))
UNSUPPORTED = ("not at", "if at", "dependentSchemas", "dependentRequired", "uniqueItems", "unevaluated", "multipleOf",
               "\\p", "only references inside", "cannot be merged")
SUBSET_FORMATS = ("time.json", "date-time.json", "email.json")
# (file, case) -> what the refusal must say, and why it is a refusal
REFUSALS = {
    ("draft2020-12/not.json", "collect annotations inside a 'not', even if collection is disabled"):
        "unevaluatedProperties at $.not.unevaluatedProperties cannot be negated",   # unevaluated* is unsupported
    ("draft2020-12/uniqueItems.json", "uniqueItems validation"): "uniqueItems at $ is not supported for items that "
                                                                 "may be arrays or objects",   # any items
    ("draft2020-12/uniqueItems.json", "uniqueItems with an array of items"): "uniqueItems at $ is not supported "
                                                                             "beside prefixItems",   # per-position items
    ("draft2020-12/uniqueItems.json", "uniqueItems with an array of items and additionalItems=false"):
        "uniqueItems at $ is not supported beside prefixItems",
    ("draft7/uniqueItems.json", "uniqueItems validation"): "uniqueItems at $ is not supported for items that may be "
                                                           "arrays or objects",
    ("draft7/uniqueItems.json", "uniqueItems with an array of items"): "uniqueItems at $ is not supported beside "
                                                                       "prefixItems, an items array",
    ("draft7/uniqueItems.json", "uniqueItems with an array of items and additionalItems=false"):
        "uniqueItems at $ is not supported beside prefixItems, an items array",
}
LISTED_FILES = {"not.json", "if-then-else.json", "uniqueItems.json"}


def layouts(value, separators, cap=48):
    """JSON texts of `value` with every order of each object's keys (up to `cap` texts)."""
    item, key = separators
    if isinstance(value, dict):
        out = []
        for order in itertools.islice(itertools.permutations(value), 24):
            for parts in itertools.islice(itertools.product(*(layouts(value[k], separators, 4) for k in order)), 8):
                out.append("{" + item.join(json.dumps(k, ensure_ascii=False) + key + p for k, p in zip(order, parts)) + "}")
        return out[:cap]
    if isinstance(value, list):
        return ["[" + item.join(p) + "]" for p in
                itertools.islice(itertools.product(*(layouts(v, separators, 4) for v in value)), cap)]
    return [json.dumps(value, ensure_ascii=False)]


def has_integral_float(value) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, dict):
        return any(has_integral_float(v) for v in value.values())
    if isinstance(value, list):
        return any(has_integral_float(v) for v in value)
    return False


def one_of_as_any_of(schema):
    if isinstance(schema, dict):
        return {("anyOf" if k == "oneOf" else k): one_of_as_any_of(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [one_of_as_any_of(v) for v in schema]
    return schema


@pytest.mark.parametrize("name", FILES)
def test_suite_file(name):
    draft, validator = VALIDATORS[name.split("/")[0]]
    checker = validator.FORMAT_CHECKER if "/format/" in name else None
    counts = {"accepted": 0, "rejected": 0, "refused": 0, "no oracle": 0, "not asserted": 0}
    for case in json.loads((SUITE / name).read_text()):
        schema, where = case["schema"], f"{name}: {case['description']}"
        oracle = validator(schema, format_checker=checker)
        listed = REFUSALS.get((name, case["description"]))
        try:
            p = Pushdown(schema_to_grammar(schema, draft=draft))
        except Unsatisfiable:
            assert not any(oracle.is_valid(t["data"]) for t in case["tests"]), f"{where}: refused as unsatisfiable"
            counts["refused"] += 1
            continue
        except (SchemaError, ConstraintTooLarge) as e:
            assert any(k in str(e) for k in UNSUPPORTED), f"{where}: refused for an unlisted reason: {e}"
            if name.split("/")[-1] in LISTED_FILES:
                assert listed is not None and listed in str(e), f"{where}: refused, not as listed: {e}"
            counts["refused"] += 1
            continue
        assert listed is None, f"{where}: listed as refused, yet it compiles"
        fullmatch = Uniqueness(p).fullmatch if p.unique else p.fullmatch
        for test in case["tests"]:
            data, what = test["data"], f"{where}: {test['description']}"
            valid = oracle.is_valid(data)
            if valid != test["valid"]:
                counts["no oracle"] += 1
                continue
            for separators in ((",", ":"), (", ", ": ")):
                accepted = any(fullmatch(text.encode()) for text in layouts(data, separators))
                if valid:
                    if has_integral_float(data) or name.endswith(SUBSET_FORMATS):
                        counts["not asserted"] += 1
                        continue
                    assert accepted, f"{what}: a valid instance is rejected ({separators})"
                    counts["accepted"] += 1
                else:
                    if "oneOf" in json.dumps(schema) and validator(one_of_as_any_of(schema)).is_valid(data):
                        counts["not asserted"] += 1
                        continue
                    assert not accepted, f"{what}: an invalid instance is accepted ({separators})"
                    counts["rejected"] += 1
    print(name, counts)
    assert counts["accepted"] + counts["rejected"] + counts["refused"] > 0


SCALARS = {"type": ["string", "number", "boolean", "null"]}


@pytest.mark.parametrize("draft", ["draft2020-12", "draft7"])
def test_unique_scalar_items_on_the_suites_instances(draft):
    """uniqueItems.json's instances that are arrays of scalars (no exponent: those are not written),
    under uniqueItems with scalar items: accepted exactly when jsonschema says valid - the run-time
    check compares values (1 and 1.0 are equal, true and 1 are not), not texts."""
    schema = {"type": "array", "items": SCALARS, "uniqueItems": True}
    check = Uniqueness(Pushdown(schema_to_grammar(schema))).fullmatch
    oracle = jsonschema.Draft202012Validator(schema)
    seen = 0
    for case in json.loads((SUITE / draft / "uniqueItems.json").read_text()):
        for test in case["tests"]:
            data = test["data"]
            if not isinstance(data, list) or any(isinstance(v, (list, dict)) or
                                                 isinstance(v, float) and "e" in json.dumps(v) for v in data):
                continue
            for separators in ((",", ":"), (", ", ": ")):
                text = json.dumps(data, separators=separators, ensure_ascii=False)
                assert check(text.encode()) == oracle.is_valid(data), (case["description"], test["description"], text)
                seen += 1
    assert seen >= 20
