"""The command line as a user runs it: real processes, the real model."""
import subprocess
import sys

import pytest


def minillm(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "minillm", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_streams_the_greedy_completion(smollm2_path):
    from minillm.generation.sampling import SamplingParams
    from minillm.llm import LLM

    expected = LLM(smollm2_path).generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                                          use_tqdm=False)[0].text
    run = minillm("generate", "The capital of France is", "--max-tokens", "8", "--model", str(smollm2_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"


@pytest.mark.slow
def test_chat_answers_resets_and_exits(smollm2_path):
    script = "What is the capital of France?\n/reset\n/exit\n"
    run = minillm("chat", "--temperature", "0", "--model", str(smollm2_path), stdin=script)
    assert run.returncode == 0, run.stderr
    assert "The capital of France is Paris." in run.stdout and "(conversation cleared)" in run.stdout


def test_bad_sampling_parameter_is_a_message_not_a_traceback():
    run = minillm("generate", "hi", "--temperature", "-1")
    assert run.returncode == 2
    assert "temperature" in run.stderr and "Traceback" not in run.stderr


def test_missing_model_file_is_a_message(tmp_path):
    run = minillm("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert run.returncode == 2
    assert "no model at" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_activations_is_an_option_with_two_choices(command):
    from minillm.cli import build_parser

    assert build_parser().parse_args([*command, "--activations", "int8"]).activations == "int8"
    assert build_parser().parse_args(command).activations == "fp32"
    run = minillm(*command, "--activations", "int4")
    assert run.returncode == 2 and "invalid choice: 'int4'" in run.stderr


def test_llm_hands_activations_to_the_loader(smollm2_path):
    from minillm.llm import LLM

    with pytest.raises(ValueError, match="activations must be one of 'fp32', 'int8', got 'int4'"):
        LLM(smollm2_path, activations="int4")


def test_a_model_that_is_not_gguf_is_named_without_its_bytes(tmp_path):
    secret = tmp_path / "id_rsa.gguf"
    secret.write_text("SECRET-KEY-MATERIAL\n")
    run = minillm("serve", "--model", str(secret), "--port", "0")
    assert run.returncode == 2 and "not a GGUF file" in run.stderr
    assert "SECRET" not in run.stderr and "Traceback" not in run.stderr


def test_serve_takes_the_abuse_limits_as_flags():
    from minillm.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.max_n == 8 and args.allowed_origins == () and not args.enable_docs and args.kv_cache_bytes is None
    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://a.example"]', "--max-n", "2"])
    assert args.allowed_origins == ("https://a.example",) and args.max_n == 2
    run = minillm("serve", "--allowed-origins", "https://a.example")
    assert run.returncode == 2 and "JSON list" in run.stderr


def test_serve_takes_a_tensor_parallel_size_and_a_token_queue_bound():
    from minillm.cli import build_parser

    assert build_parser().parse_args(["serve"]).tensor_parallel_size == 1
    assert build_parser().parse_args(["serve"]).max_queued_tokens == 16384
    assert build_parser().parse_args(["serve", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    run = minillm("serve", "--replicas", "2", "--tensor-parallel-size", "2")
    assert run.returncode == 2 and "--tensor-parallel-size and --replicas" in run.stderr, run.stderr


# every knob once: a value other than its default, as its flag and as the config field
ENGINE_VALUES = {"model": "m.gguf", "backend": "reference", "activations": "int8", "kv_cache_bytes": 1 << 20,
                 "block_size": 8, "max_num_seqs": 3, "max_num_batched_tokens": 64, "max_n": 2, "max_model_len": 100,
                 "jump_forward": False, "speculative": {"method": "ngram", "num_speculative_tokens": 2},
                 "tensor_parallel_size": 2, "threads": 1, "device": "cuda"}


def flags_for(values: dict) -> list[str]:
    import json

    flags = []
    for name, value in values.items():
        if name == "jump_forward":
            flags.append("--no-jump-forward")
        elif name == "speculative":
            flags += ["--speculative-config", json.dumps(value)]
        elif value is True:
            flags.append("--" + name.replace("_", "-"))
        elif isinstance(value, tuple):
            flags += ["--" + name.replace("_", "-"), json.dumps(list(value))]
        else:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_every_engine_config_field_is_one_flag(command):
    import dataclasses

    from minillm.cli import build_parser, config_from_args
    from minillm.runtime.config import EngineConfig

    assert set(ENGINE_VALUES) == {f.name for f in dataclasses.fields(EngineConfig)}  # a new knob joins this test
    args = build_parser().parse_args([*command, *flags_for(ENGINE_VALUES)])
    assert config_from_args(EngineConfig, args) == EngineConfig(**ENGINE_VALUES)
    defaults = config_from_args(EngineConfig, build_parser().parse_args(command))
    assert defaults == EngineConfig(max_n=8 if command == ["serve"] else None)  # the server's abuse limit


def test_every_server_config_field_is_one_flag_and_0_is_no_limit():
    import dataclasses

    from minillm.cli import build_parser, config_from_args
    from minillm.serve.config import ServerConfig

    values = {"host": "0.0.0.0", "port": 9, "served_model_name": "smol", "api_key": "k", "protect_metrics": True,
              "allowed_origins": ("https://a.example",), "allowed_hosts": ("llm.internal",), "enable_docs": True,
              "max_body_bytes": 10, "max_waiting": 3, "max_queued_tokens": 7, "max_request_tokens": 5,
              "request_timeout": 2.5, "log_interval": 1.0, "drain_timeout": 4.0, "log_level": "debug", "replicas": 2,
              "routing": "round-robin", "ray_dashboard": True}
    assert set(values) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert config_from_args(ServerConfig, build_parser().parse_args(["serve", *flags_for(values)])) == \
        ServerConfig(**values)
    assert config_from_args(ServerConfig, build_parser().parse_args(["serve"])) == ServerConfig()
    unlimited = ["--max-body-bytes", "0", "--max-queued-tokens", "0", "--max-request-tokens", "0", "--request-timeout", "0"]
    got = config_from_args(ServerConfig, build_parser().parse_args(["serve", *unlimited]))
    assert (got.max_body_bytes, got.max_queued_tokens, got.max_request_tokens, got.request_timeout) == (None,) * 4


def test_a_bad_speculative_flag_is_named():
    run = minillm("generate", "hi", "--speculative-config", '{"method": "ngram"}')
    assert run.returncode == 2 and "--speculative-config" in run.stderr and "num_speculative_tokens" in run.stderr
    assert "Traceback" not in run.stderr


def test_an_unknown_llm_option_is_named_with_the_known_ones():
    from minillm.llm import LLM
    from minillm.runtime.config import EngineConfig

    with pytest.raises(TypeError, match="unknown engine option 'max_num_sqs'; the options are model, backend"):
        LLM(max_num_sqs=4)  # before: accepted by LLM, and a TypeError from LLMEngine after the model loaded
    with pytest.raises(TypeError, match="unknown engine option 'nope'"):
        EngineConfig.create(EngineConfig(max_num_seqs=2), nope=1)
    assert EngineConfig.create(EngineConfig(max_num_seqs=2), max_n=1) == EngineConfig(max_num_seqs=2, max_n=1)
