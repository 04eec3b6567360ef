"""Chat templates against `transformers`' apply_chat_template, the renderer the models were trained with."""
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from minillm.generation.chat import render_chat
from minillm.model.gguf import GGUFFile

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "Another one, bigger?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Line one\nline two\n\n  indented"}],
    [{"role": "user", "content": "大语言模型 👨‍👩‍👧 <b>&amp;</b> \"quoted\" {{ not jinja }}"}],
]


def hf_render(template: str, messages, add_generation_prompt=True, bos="<s>", eos="</s>") -> str:
    """transformers' own rendering: a tokenizer object that only carries the template and specials."""
    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.BPE()), bos_token=bos, eos_token=eos,
                                  chat_template=template)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def smollm_template(smollm2_path):
    return GGUFFile(smollm2_path).metadata["tokenizer.chat_template"]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_renders_like_transformers(smollm_template, messages, add_generation_prompt):
    ours = render_chat(messages, smollm_template, add_generation_prompt=add_generation_prompt,
                       bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert ours == hf_render(smollm_template, messages, add_generation_prompt, "<|im_start|>", "<|im_end|>")


@pytest.mark.slow
def test_smollm_template_inserts_the_default_system_turn(smollm_template):
    assert render_chat(CONVERSATIONS[0], smollm_template) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_is_chatml():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert render_chat(messages, add_generation_prompt=False) == expected
    assert render_chat(messages) == expected + "<|im_start|>assistant\n"


# Templates that lean on the environment transformers sets up: whitespace control (trim_blocks,
# lstrip_blocks), loop controls, tojson without HTML escaping, special-token variables, namespaces,
# and `tools` being defined (as None) even when no tools are given.
FEATURE_TEMPLATES = [
    """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    [{{ message['role'] | upper }}] {{ message['content'] | trim }}
    {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}""",
    """{% for m in messages %}{{ m | tojson }}|{{ m.content | tojson(indent=2) }}
{% endfor %}""",
    """{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length %}{% endfor %}
total={{ ns.n }} tools={{ tools is defined }}/{{ tools is none }} last={{ messages[-1]['role'] }}
{%- if add_generation_prompt %}>{% endif %}""",
]


@pytest.mark.parametrize("template", FEATURE_TEMPLATES)
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_jinja_environment_matches_transformers(template, messages):
    assert render_chat(messages, template, bos_token="<s>", eos_token="</s>") == hf_render(template, messages)


def test_raise_exception_in_a_template_is_a_value_error():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    assert render_chat([{"role": "user", "content": "x"}], template) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        render_chat([{"role": "assistant", "content": "x"}], template)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",                     # reaching Python internals
    "{{ messages.append({'role': 'user'}) }}",        # mutating the conversation
])
def test_templates_run_in_a_sandbox(template):
    with pytest.raises(ValueError, match="rejected"):
        render_chat([{"role": "user", "content": "x"}], template)


def test_invalid_jinja_is_a_value_error():
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat([{"role": "user", "content": "x"}], "{% for m in messages %}")


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert render_chat([{"role": "user", "content": parts}]) == render_chat([{"role": "user", "content": "Hello, world"}])


@pytest.mark.parametrize("messages, problem", [
    ("hi", "non-empty list"),
    ([], "non-empty list"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], r"messages\[1\] has role 'wizard'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": 42}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
])
def test_bad_messages_are_refused_clearly(messages, problem):
    with pytest.raises(ValueError, match=problem):
        render_chat(messages)


@pytest.mark.slow
def test_a_second_chat_turn_reuses_the_first_from_the_prefix_cache(smollm2_path):
    """As `minillm chat` runs a conversation: each turn streams through one engine, so the next turn's
    prompt (the whole conversation again) finds the earlier turns' full KV blocks cached."""
    from minillm.generation.sampling import SamplingParams
    from minillm.llm import LLM

    llm = LLM(smollm2_path, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first_prompt = llm.chat_prompt(history)
    first = llm.chat(history, params)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second_prompt = llm.chat_prompt(history)
    before = llm.engine.stats()
    "".join(llm.stream(second_prompt, params))
    after = llm.engine.stats()

    # Cached: the full blocks of every token the first turn computed (its last token was drawn, never run);
    # found: the full blocks of the common prefix, never the prompt's last token.
    computed = first_prompt + first.token_ids[:-1]
    common = next((i for i, (a, b) in enumerate(zip(computed, second_prompt)) if a != b),
                  min(len(computed), len(second_prompt)))
    expected = min(common, len(second_prompt) - 1) // 16 * 16
    assert expected >= len(first_prompt) // 16 * 16 > 0
    assert after.prefix_cache_hits - before.prefix_cache_hits == expected
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second_prompt)
