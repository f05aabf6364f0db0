"""`tp3d plan` prints the ledger, emits JSON, and refuses bad layouts with one line."""

from __future__ import annotations

import json

import pytest

from lightning_tp3d.cli import main
from lightning_tp3d.plan.layout import ParallelLayout


def test_plan_deepseek_7b_json(capsys):
    assert main(["plan", "deepseek-llm-7b", "--tp", "8", "--pp", "4", "--dp", "2", "--num-microbatches", "8",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["training"]["model_parameters"] == 6_910_365_696
    assert [stage["parameters"] for stage in report["training"]["stages"]] == [229_564_416, 202_440_704,
                                                                               202_440_704, 229_568_512]
    assert report["training"]["layout"]["tensor_parallel_size"] == 8
    assert {option["tensor_parallel_size"] for option in report["serving"]["options"] if option["valid"]} == {
        1, 2, 4, 8, 16}


def test_plan_table_and_config_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}))
    assert main(["plan", str(config), "--tp", "2", "--pp", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "peak per rank" in out and "deploy tp" in out and "0-1" in out


def test_plan_refuses_bad_layout_with_one_line(capsys):
    assert main(["plan", "deepseek-llm-67b", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tp3d plan: error: tensor_parallel_size=3 does not divide num_attention_heads=64; choose a"
                   " tensor_parallel_size that divides 64 (valid: [1, 2, 4, 8, 16, 32, 64]).")
    assert main(["plan", "no-such-model"]) == 2
    assert "Unknown model 'no-such-model'" in capsys.readouterr().err


def test_plan_of_a_mixture_of_experts_model_prints_its_ledgers(capsys):
    """`plan.moe_training`'s memory and `plan.moe_communication`'s traffic through the command line (hand-checked
    in tests/plan/test_moe_training.py, measured in tests/models/test_deepseek.py); --ep on a dense model and
    what the MoE plan does not count are refused."""
    arguments = ["plan", "deepseek-v3", "--tp", "8", "--pp", "16", "--dp", "64", "--ep", "8", "--num-microbatches",
                 "32", "--precision", "bf16-mixed", "--recompute", "full"]
    assert main([*arguments, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["routed_expert_parameters_per_rank"] == 10_217_324_544 * 8
    stages = report["communication"]["stages"]
    assert stages[0]["per_group"]["ep"]["calls"] == 0
    assert stages[15]["per_group"]["ep"]["calls"] == 32 * 3 * (5 + 3)  # full recompute replays 3 per block
    assert set(stages[15]["per_group"]) == {"tp", "pp", "dp", "ep", "edp"}
    memory = report["training"]["stages"]
    assert [stage["in_flight_microbatches"] for stage in memory] == list(range(16, 0, -1))
    assert all(stage["activation_bytes"] > 0 for stage in memory)
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "671.0e9 parameters, 36.6e9 active" in out and "32 of each block's 256 routed experts" in out
    assert main([*arguments, "--bandwidth", "ep=50", "edp=25", "--json"]) == 0  # each expert group's links
    bandwidth = json.loads(capsys.readouterr().out)["communication"]["bandwidth_bytes_per_second"]
    assert (bandwidth["ep"], bandwidth["edp"]) == (50e9, 25e9)
    assert "   15     58-60 " in out and "peak per rank:" in out and "   15   edp " in out
    assert main(["plan", "deepseek-llm-7b", "--ep", "2"]) == 2
    assert "--ep 2 splits routed experts, but deepseek-llm-7b has none" in capsys.readouterr().err
    assert main(["plan", "deepseek-v3", "--plot", "plan.png", "--lora-rank", "8"]) == 2
    assert ("--plot (without --gpus), --lora-rank / --qlora with a mixture-of-experts model is not planned yet;"
            " plan it without them" in capsys.readouterr().err)


def test_the_advisor_ranks_expert_parallel_layouts_of_a_mixture_of_experts_model(capsys):
    """`tp3d plan MODEL --gpus N` for DeepSeek-V2-Lite searches the expert-parallel sizes too (dividing dp and the
    64 experts), prints them in an ep column, and refuses a LoRA fine-tune it does not count."""
    arguments = ["plan", "deepseek-v2-lite", "--gpus", "16", "--gpu-memory", "80GiB", "--global-batch-size", "64",
                 "--precision", "bf16-mixed"]
    assert main([*arguments, "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)
    sizes = {(row["data_parallel_size"], row["expert_parallel_size"]) for row in candidates}
    assert {(16, 16), (16, 8), (16, 1), (8, 8), (2, 2), (1, 1)} <= sizes
    assert all(dp % ep == 0 for dp, ep in sizes)
    assert main([*arguments, "--wide"]) == 0
    header = capsys.readouterr().out.splitlines()[2].split()
    assert header[:5] == ["#", "tp", "pp", "dp", "ep"] and header[-10:-5] == ["tp", "pp", "dp", "ep", "edp"]
    assert main([*arguments, "--lora-rank", "8"]) == 2
    assert "the mixture-of-experts plan counts full training only" in capsys.readouterr().err


def test_plan_serve_of_a_mixture_of_experts_model_prints_expert_parallel_servers(capsys):
    """`plan.serving.serving_plan` (hand-checked in tests/plan/test_serving.py) through the command line:
    a tensor- and a data-parallel server per size, vLLM's expert-parallel flag in their commands."""
    arguments = ["plan", "deepseek-v3", "--serve", "--gpu-memory", "141GiB", "--max-model-len", "8192",
                 "--deploy-tp", "8", "16"]
    assert main(arguments) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[2:6]] == [["tp", "8", "+"], ["dp", "8", "+"], ["tp", "16", "+"],
                                                          ["dp", "16", "+"]]
    assert lines[2].endswith("does not fit") and not lines[4].endswith("does not fit")
    assert ("vllm serve deepseek-v3 --tensor-parallel-size 16 --enable-expert-parallel --dtype bfloat16"
            " --gpu-memory-utilization 0.9 --max-model-len 8192 --max-num-seqs ") in "\n".join(lines)
    assert main([*arguments, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["serving_plan"]
    assert [(plan["tensor_parallel_size"], plan["data_parallel_size"], plan["expert_parallel"]) for plan in plans] \
        == [(8, 1, True), (1, 8, True), (16, 1, True), (1, 16, True)]
    assert main(["plan", "deepseek-v3", "--serve", "--deploy-tp", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tp3d plan: error: 3 GPUs cannot serve this model with expert parallelism: 3 does not divide"
        " n_routed_experts=256.")
    assert main(["plan", "deepseek-v3", "--serve", "--max-model-len", "200000"]) == 2
    assert "exceeds the model's max_position_embeddings=163840" in capsys.readouterr().err


def test_plan_serve_prints_the_plan_and_the_vllm_commands(capsys):
    assert main(["plan", "deepseek-llm-67b", "--serve", "--gpu-memory", "80GiB", "--max-model-len", "4096",
                 "--deploy-tp", "1", "4", "8"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out.splitlines()[2]  # tp 1: 125.6 GiB of weights
    assert ("vllm serve deepseek-llm-67b --tensor-parallel-size 4 --dtype bfloat16 --gpu-memory-utilization 0.9"
            " --max-model-len 4096 --max-num-seqs 109") in out
    assert "--tensor-parallel-size 1 " not in out
    assert main(["plan", "deepseek-llm-7b", "--serve", "--json", "--max-model-len", "4096"]) == 0
    plans = json.loads(capsys.readouterr().out)["serving_plan"]
    assert [(plan["tensor_parallel_size"], plan["max_num_seqs"]) for plan in plans][:1] == [(1, 31)]
    assert main(["plan", "deepseek-llm-7b", "--serve", "--deploy-tp", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("tp3d plan: error: deploy tensor_parallel_size=3 is not valid for this"
                                               " model: 3 does not divide num_attention_heads=32.")


def test_doctor_buffers_follow_the_backend_not_the_machine():
    from lightning_tp3d.cli import doctor_device_type

    assert doctor_device_type("gloo") == "cpu" and doctor_device_type("nccl") == "cuda"
    with pytest.raises(ValueError, match="not one of 'nccl', 'gloo'"):
        doctor_device_type("mpi")


def test_plan_applies_the_operating_rules(capsys):
    """tp inside a node, micro-batches for 1F1B with the bubble figure, max model length within the
    model's positions, and the 0.85 retry advice for serving."""
    assert main(["plan", "deepseek-llm-7b", "--tp", "8", "--pp", "8", "--num-microbatches", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tp3d plan: error: pipeline_schedule='1f1b' needs num_microbatches >= pipeline_parallel_size, got"
        " num_microbatches=2 < 8; raise num_microbatches or use 'gpipe'.")
    assert main(["plan", "deepseek-llm-7b", "--tp", "8", "--pp", "8", "--num-microbatches", "2",
                 "--schedule", "gpipe"]) == 0
    assert ("pipeline bubble in theory (gpipe): (pp - 1) / (m + pp - 1)\n  = 78% of each step\n"
            "  num_microbatches >= 4 x pp = 32 brings it to 18%\n") in capsys.readouterr().out
    assert main(["plan", "deepseek-llm-7b", "--tp", "8", "--pp", "4", "--num-microbatches", "16",
                 "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "pipeline bubble in theory (1f1b): (pp - 1) / (m + pp - 1)\n  = 16% of each step\n" in out
    assert "brings it to" not in out
    assert main(["plan", "deepseek-llm-67b", "--tp", "16", "--pp", "4", "--gpus-per-node", "8"]) == 2
    assert "tensor_parallel_size=16 does not fit inside a node of 8 GPUs" in capsys.readouterr().err
    assert main(["plan", "deepseek-llm-7b", "--serve", "--max-model-len", "8192"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tp3d plan: error: max_model_len=8192 exceeds the model's max_position_embeddings=4096, which vLLM"
        " refuses; serve at most 4096 tokens per sequence (or a model with longer positions).")
    assert main(["plan", "deepseek-llm-7b", "--serve"]) == 0
    out = capsys.readouterr().out
    assert "--max-model-len 4096" in out and "retry with --gpu-memory-utilization 0.85" in out


def test_plan_counts_a_lora_fine_tune_and_the_advisor_ranks_its_layouts(capsys):
    """`--lora-rank`: gradients and optimizer state for the factors alone, r (in + out / t) per column-parallel
    and r (in / t + out) per row-parallel target and rank; the weights keep the base's bytes."""
    assert main(["plan", "deepseek-llm-7b", "--tp", "2", "--pp", "2", "--lora-rank", "16", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["training"]["stages"][0]
    assert main(["plan", "deepseek-llm-7b", "--tp", "2", "--pp", "2", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["training"]["stages"][0]
    h, layers, r = 4096, 15, 16  # 30 layers over 2 stages; q, k, v column parallel (h x h), o row parallel
    per_layer = 3 * r * (h + h // 2) + r * (h // 2 + h)
    assert lora["trainable_parameters"] == layers * per_layer
    assert lora["parameters"] == full["parameters"] + layers * per_layer and lora["weight_bytes"] > full["weight_bytes"]
    assert lora["gradient_bytes"] == 4 * layers * per_layer and lora["optimizer_bytes"] == 8 * layers * per_layer
    assert main(["plan", "deepseek-llm-7b", "--gpus", "16", "--global-batch-size", "64", "--seq-len", "2048",
                 "--lora-rank", "16", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["lora_rank"] == 16 and best["fits"]


def test_plan_counts_a_qlora_base_in_4_bit_and_the_advisor_keeps_to_tp_1(capsys):
    """`--qlora`: the blocks' projections cost NF4 bytes (`plan.qlora.nf4_bytes`: 0.516 per weight at the
    paper's blocks, fp32 scales under bf16-mixed), the embedding and head theirs; what trains is LoRA's."""
    args = ["plan", "deepseek-llm-7b", "--pp", "2", "--lora-rank", "16", "--json"]
    assert main(args) == 0
    lora = json.loads(capsys.readouterr().out)["training"]["stages"][0]
    assert main(args + ["--qlora"]) == 0
    qlora = json.loads(capsys.readouterr().out)["training"]["stages"][0]
    h, f, layers = 4096, 11008, 15
    projections = [h * h] * 4 + [f * h] * 3
    nf4 = sum(n // 2 + n // 64 + (n // 16384 + 17) * 4 for n in projections)
    assert qlora["weight_bytes"] == lora["weight_bytes"] - layers * (4 * sum(projections) - nf4)
    assert {key: qlora[key] for key in ("gradient_bytes", "optimizer_bytes", "trainable_parameters")} == {
        key: lora[key] for key in ("gradient_bytes", "optimizer_bytes", "trainable_parameters")}
    assert main(["plan", "deepseek-llm-7b", "--gpus", "8", "--global-batch-size", "64", "--seq-len", "2048",
                 "--lora-rank", "16", "--qlora", "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)
    assert candidates and {candidate["tensor_parallel_size"] for candidate in candidates} == {1}
    assert all(candidate["qlora"] == {"block_size": 64, "scaler_block_size": 256} for candidate in candidates)
    assert main(["plan", "deepseek-llm-7b", "--tp", "2", "--lora-rank", "16", "--qlora"]) == 2
    assert "tensor parallelism cannot split a 4-bit NF4 weight" in capsys.readouterr().err
    assert main(["plan", "deepseek-llm-7b", "--qlora"]) == 2
    assert "--qlora needs --lora-rank R" in capsys.readouterr().err


def test_help_lists_every_sub_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "plan", "export", "check", "verify", "doctor"):
        assert f"\n    {command} " in usage, command


def test_check_of_a_folder_without_config_says_what_it_needs(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == (f"tp3d check: error: {tmp_path / 'missing'} is not a Hugging Face"
                                               " folder (no config.json in it); write one with `tp3d export"
                                               " CHECKPOINT OUTPUT`.")


def test_only_the_package_s_own_refusals_become_one_line_errors():
    """`tp3d fit` prints this package's refusals (layout, options, features, checkpoints) as one line; an
    error raised in a user's module or a library keeps its traceback."""
    from lightning_tp3d.cli import _raised_here
    from lightning_tp3d.plan.units import parse_size

    def raised(function) -> BaseException:
        try:
            function()
        except Exception as error:  # noqa: BLE001 - the error itself is under test
            return error
        raise AssertionError("nothing raised")

    assert _raised_here(raised(lambda: ParallelLayout.resolve(world_size=3, tensor_parallel_size=2)))
    assert _raised_here(raised(lambda: parse_size("lots")))
    assert not _raised_here(raised(lambda: int("user code")))  # raised in the standard library, for a user
    assert not _raised_here(raised(lambda: (_ for _ in ()).throw(ValueError("a user's module"))))


def test_plan_defaults_follow_the_model_and_units_fit_the_numbers(capsys):
    """A model of 256 positions plans 256-token sequences (said once), its megabytes in MiB; a longer
    --seq-len is refused."""
    assert main(["plan", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "sequences of 256 tokens\n(the model's 256 positions; --seq-len to choose)" in out
    assert out.count("positions; --seq-len to choose") == 1
    assert "total MiB" in out and "peak per rank: 0.00" not in out and "0.00 GiB" not in out
    assert main(["plan", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["options"]["seq_len"] == 256
    assert main(["plan", "deepseek-llm-7b"]) == 0
    assert "sequences of 4096 tokens\n" in capsys.readouterr().out  # its own positions: nothing to say
    assert main(["plan", "tiny", "--seq-len", "1000"]) == 2
    assert "longer than the model's max_position_embeddings=256" in capsys.readouterr().err
