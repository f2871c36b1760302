"""Smoke tests of the benchmark scripts: each runs end to end in a quick mode and writes its JSON."""

import importlib
import json
import math
import resource
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _benchmark(name, monkeypatch):
    """The script ``benchmarks/<name>.py`` as a module (scripts import their siblings by name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.mark.slow      # ~10 s on an idle machine, 25-50 s while others share the 2 cores
def test_train_step_benchmark_quick(monkeypatch, tmp_path, capsys):
    train_step = _benchmark("train_step", monkeypatch)
    out = tmp_path / "train_step.json"
    # --default-allocator: the script's mallopt settings would outlive it in the test process.
    # the fp32 rows and their verdicts (the bf16 tables are the moe_layer test's)
    assert train_step.main(["--quick", "--repeats", "3", "--profile", "--default-allocator", "--dtype", "fp32",
                            "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {row["name"]: row for row in results["rows"]}
    timed = [name for name, row in rows.items() if "skipped" not in row]
    hf_rows = [name for name in timed if name.startswith("hf/")]
    assert {"bound", "extended bound", "megamoe/torch", "megamoe/loop", "hf/eager", "hf/grouped_mm"} <= set(rows)
    assert {"hf/deepgemm", "hf/sonicmoe"} <= {name for name, row in rows.items() if "skipped" in row}
    for name in timed:
        row = rows[name]
        assert row["repeats"] == 3 and len(row["times_s"]) == 3 and row["min_s"] == min(row["times_s"])
        assert row["spread"] == pytest.approx(row["median_s"] / row["min_s"])
        assert row["tokens_per_s"] == pytest.approx(results["tokens_per_step"] / row["min_s"])   # on the minimum
        assert set(row["tokens_per_s_over_hf"]) == set(hf_rows)
    # The extended bound is the bound plus the dense non-GEMM work, run in the same step.
    assert rows["extended bound"]["over_extended_bound"] == 1.0
    # The verdicts are of the default backend's minimum against the others' minima.
    default = f"megamoe/{results['default_backend']}"
    verdicts = results["verdicts"]
    assert verdicts["over_extended_bound"]["value"] == pytest.approx(
        rows[default]["min_s"] / rows["extended bound"]["min_s"])
    assert verdicts["tokens_per_s_over_hf_grouped_mm"]["value"] == pytest.approx(
        rows["hf/grouped_mm"]["min_s"] / rows[default]["min_s"])
    assert verdicts["over_fastest_other_backend"]["value"] == pytest.approx(
        rows[default]["min_s"] / min(r["min_s"] for n, r in rows.items() if n.startswith("megamoe/") and n != default))
    assert set(results["noisy_rows"]) == {n for n in timed if rows[n]["spread"] > train_step.NOISY_SPREAD}
    assert ("WARNING: median/min" in capsys.readouterr().out) == bool(results["noisy_rows"])
    # The profile breaks every timed row down by op category.
    assert set(results["profile_ms_per_step"]) == set(timed)
    assert all(p["GEMM"] > 0 and p["sum"] > 0 for p in results["profile_ms_per_step"].values())
    # The loss check ran: every row's first loss is the same (the script asserts it, to 1e-4).
    assert set(results["loss_check"]) == set(timed) - {"bound", "extended bound"}
    first_losses = [losses[0] for losses in results["loss_check"].values()]
    assert max(first_losses) - min(first_losses) <= 1e-4


@pytest.mark.slow      # ~10 s on an idle machine
def test_moe_layer_benchmark_on_a_small_shape(monkeypatch, tmp_path):
    moe_layer = _benchmark("moe_layer", monkeypatch)
    out = tmp_path / "moe_layer.json"
    assert moe_layer.main(["--quick", "--default-allocator", "--shape", "64", "32", "16", "8", "2", "--threads", "1",
                           "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["threads"] == 1
    entry, bf16_entry = results["shapes"]             # one table per dtype
    assert (entry["dtype"], bf16_entry["dtype"]) == ("fp32", "bf16")
    assert {row["name"] for row in bf16_entry["rows"]} == {row["name"] for row in entry["rows"]}
    assert all(row["train_step_ratio"] > 0 for row in bf16_entry["rows"] if "skipped" not in row)
    assert entry["T_H_F_E_K"] == [64, 32, 16, 8, 2] and entry["target_megamoe_torch_train"] is None
    rows = {row["name"]: row for row in entry["rows"]}
    assert {"bound", "megamoe/torch", "megamoe/loop", "qwen3_moe/eager", "mixtral/grouped_mm"} <= set(rows)
    assert rows["bound"]["train_step_ratio"] == 1.0 and rows["bound"]["train_step_min_ratio"] == 1.0
    for name in ("megamoe/torch", "megamoe/loop"):
        assert rows[name]["forward"]["repeats"] == 3 and rows[name]["train_step_ratio"] > 0
        train = rows[name]["train_step"]
        assert rows[name]["train_step_spread"] == pytest.approx(train["median_s"] / train["min_s"])
    assert set(entry["noisy_rows"]) == {n for n, r in rows.items()
                                        if "train_step_spread" in r and r["train_step_spread"] > moe_layer.NOISY_SPREAD}


# The rows' logic on a tiny model, eager rows only (a few seconds; the compiled rows are generate(compiled=True),
# whose tokens tests/unit/test_inference.py and tests/multirank/test_inference.py check against eager decoding).
TINY_DECODE_MODEL = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_experts=4, moe_intermediate_size=32,
                         intermediate_size=64)


def test_decode_benchmark_generates_the_same_ids_as_transformers(monkeypatch, tmp_path):
    decode = _benchmark("decode", monkeypatch)
    monkeypatch.setattr(decode, "MODEL", dict(decode.MODEL, **TINY_DECODE_MODEL))
    out = tmp_path / "decode.json"
    assert decode.main(["--quick", "--threads", "1", "--prompt-lens", "32", "--dtype", "fp32", "--eager-only",
                        "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(row["batch"], row["prompt_len"], row["dtype"]) for row in results["rows"]] == [(1, 32, "fp32"),
                                                                                            (8, 32, "fp32")]
    for row in results["rows"]:
        assert row["same_token_ids"] == {"megamoe": True}, \
            f"batch {row['batch']}: megamoe and transformers generated different ids: {row['same_token_ids']}"
        assert row["agreeing_tokens"] == {"megamoe": results["new_tokens"]}
        assert set(row["implementations"]) == {"transformers", "megamoe"}
        for timings in row["implementations"].values():
            assert len(timings["full_s"]) == 3 and timings["decode_tokens_per_s"] > 0
    assert results["target_judged_at_threads"] == [1]        # the only count measured, default or not
    assert results["target_met"] == all(row["decode_speedup"]["megamoe"] >= 2 for row in results["rows"])


def test_decode_benchmark_bf16_rows_measure_the_agreeing_prefix(monkeypatch, tmp_path):
    decode = _benchmark("decode", monkeypatch)
    monkeypatch.setattr(decode, "MODEL", dict(decode.MODEL, **TINY_DECODE_MODEL))
    out = tmp_path / "decode.json"
    assert decode.main(["--quick", "--threads", "1", "--prompt-lens", "32", "--dtype", "bf16", "--eager-only",
                        "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(row["batch"], row["dtype"]) for row in results["rows"]] == [(1, "bf16"), (8, "bf16")]
    for row in results["rows"]:
        agree = row["agreeing_tokens"]["megamoe"]
        assert 0 <= agree <= results["new_tokens"]
        assert row["same_token_ids"]["megamoe"] == (agree == results["new_tokens"])
        assert row["decode_speedup"]["megamoe"] > 0
    assert decode.agreeing_tokens([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == 2


@pytest.mark.slow      # ~10 s: nine conversions of one-layer checkpoints, one in a child process
def test_convert_benchmark_rotates_the_steps(monkeypatch, tmp_path):
    convert = _benchmark("convert", monkeypatch)
    out = tmp_path / "convert.json"
    # The first timed import-hf runs as the benchmark runs every conversion, in a child (its imports timed
    # apart, its peak RSS read from /proc); the others run the same command in this process, whose imports
    # are done (each child costs seconds of imports): the rotation and the table are what is tested here.
    from megamoe.cli.convert import main as convert_command
    in_a_child, calls = convert.convert, []

    def in_this_process(argv):
        start = time.perf_counter()
        assert convert_command(argv) == 0
        took = time.perf_counter() - start
        return {"startup_s": 0.0, "conversion_s": took,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def first_timed_import_in_a_child(argv):     # calls[0]: the untimed import every export-hf reads
        calls.append(argv[0])
        return in_a_child(argv) if len(calls) == 2 else in_this_process(argv)
    monkeypatch.setattr(convert, "convert", first_timed_import_in_a_child)
    convert.main(["--size-gb", "0.05", "--repeats", "3", "--fp8-size-gb", "0.01", "--fp8-repeats", "1",
                  "--fp8-experts", "4", "--json", str(out), "--workdir", str(tmp_path)])
    results = json.loads(out.read_text())
    assert [order[0] for order in results["orders"]] == ["cp", "import-hf", "export-hf"]   # each step first once
    assert all(sorted(order) == ["cp", "export-hf", "import-hf"] for order in results["orders"])
    assert len(results["cp_sync_runs_s"]) == 3 and results["cp_sync_s"] > 0
    assert calls[:2] == ["import-hf", "import-hf"] and len(calls) == 1 + 6 + 2
    child = results["steps"]["import-hf"]["runs"][0]
    assert child["startup_s"] > 0 and child["conversion_s"] > 0 and child["peak_rss_bytes"] > 0
    for step in ("import-hf", "export-hf"):
        entry = results["steps"][step]
        assert len(entry["runs"]) == 3 and entry["x_cp_sync"] > 0
        assert 0 < entry["peak_rss_bytes"] and entry["rss_target_met"] == (
            entry["peak_rss_bytes"] <= results["peak_rss_budget_bytes"])
    fp8 = results["fp8"]          # the block-FP8 row: one round, the checkpoint's e4m3 weights dequantized and kept
    assert fp8["orders"] == [["cp", "import-hf bf16", "import-hf keep"]] and fp8["checkpoint"]["num_layers"] == 1
    assert fp8["checkpoint"]["experts"] == 4
    for step in ("import-hf bf16", "import-hf keep"):
        entry = fp8["steps"][step]
        assert len(entry["runs"]) == 1 and entry["x_cp_sync"] > 0 and entry["rss_target_met"] == (
            entry["peak_rss_bytes"] <= fp8["peak_rss_budget_bytes"])
    assert [p.name for p in tmp_path.iterdir()] == ["convert.json"]      # the work directory is gone


def test_checkpoint_load_benchmark_hashes_in_the_verified_load_only(monkeypatch, tmp_path):
    from megamoe.checkpoint import checksums
    bench = _benchmark("checkpoint_load", monkeypatch)
    hashed = []
    real_check = checksums.check_entry
    monkeypatch.setattr(checksums, "check_entry", lambda path, recorded: hashed.append(path) or real_check(path,
                                                                                                         recorded))
    out = tmp_path / "load.json"
    assert bench.main(["--size-gb", "0.02", "--repeats", "2", "--json", str(out), "--workdir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert results["orders"] == [list(bench.STEPS), list(bench.STEPS[::-1])]
    assert len(hashed) == 2 * results["files"]          # every file, in each verified load, and nowhere else
    for row in results["steps"].values():
        assert len(row["runs_s"]) == 2 and row["min_s"] <= row["median_s"]
    assert results["verified_x_load_min"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["load.json"]      # the checkpoint is gone


def test_layout_plan_benchmark_quick_plans_once_per_role_and_matches_the_reference(monkeypatch, tmp_path, capsys):
    bench = _benchmark("layout_plan", monkeypatch)
    out = tmp_path / "layout_plan.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["name"] for row in rows] == [case[0] for case in bench.QUICK_CASES]
    for row in rows:
        assert row["equal_to_reference"] is True and row["reference_models_built"] == row["world"] == 8
        assert row["models_built"] == row["pp"] * math.lcm(row["tp"], row["etp"]) < row["world"]
        assert row["peak_rss"] >= row["base_rss"] > 0 and row["chunks"] >= row["tensors"] > 0
        assert row["manifest_fields_bytes"] > 0
    assert "tp2-ep4-pp2-fold" in capsys.readouterr().out


def test_eplb_benchmark_simulated_quick(monkeypatch, tmp_path, capsys):
    eplb = _benchmark("eplb", monkeypatch)
    out = tmp_path / "eplb.json"
    assert eplb.main(["--quick", "--json", str(out)]) == 0
    simulated = json.loads(out.read_text())["simulated"]
    assert [e["config"] for e in simulated["drift"]] == [c.name for c in eplb.QUICK_CONFIGS]
    for entry in simulated["drift"]:
        rows = entry["rows"]
        assert list(rows) == ["static", "from scratch", "from scratch, ranks matched", "movement-aware"]
        assert rows["static"]["moved"] == 0 and rows["static"]["rebalance_61_layers_s"] == 0
        # Relabelling ranks never changes the balancedness.
        matched, scratch = rows["from scratch, ranks matched"], rows["from scratch"]
        assert matched["balancedness"] == pytest.approx(scratch["balancedness"])
        for row in rows.values():
            assert 0 <= row["moved"] <= row["max_moved"] <= 1
            assert 0 < row["min_balancedness"] <= row["balancedness"] <= 1
            assert row["rebalance_61_layers_s"] <= row["slowest_rebalance_61_layers_s"]
    flat = simulated["drift"][0]  # the bound holds for any flat placement
    assert all(row["own_balancedness"] <= flat["bound"] + 1e-9 for row in flat["rows"].values())
    verdicts = simulated["verdicts"]
    assert verdicts["noise"]["met"] == all(e["met"] for e in simulated["noise"])
    # Quick mode runs no configuration at EP 32, which the drift and time targets are for.
    assert not verdicts["drift"]["met"] and not verdicts["time"]["met"]
    shown = capsys.readouterr().out
    assert all(f"target {v['target']}: {'met' if v['met'] else 'NOT met'}" in shown for v in verdicts.values())


def test_eplb_benchmark_real_part_runs_eplb_real_and_reports_its_errors(monkeypatch, tmp_path, capsys):
    eplb = _benchmark("eplb", monkeypatch)
    out = tmp_path / "eplb.json"
    assert eplb.main(["--part", "real", "--real-ranks", "3", "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --real-ranks 3 must divide the model's 20 expert slots"] and not out.exists()
    # The real half's own flags reach it, and its rows go into the same JSON (the run itself is
    # test_eplb_real_benchmark_rebalances_and_writes_its_table's).
    calls = []
    monkeypatch.setattr(eplb.eplb_real, "run", lambda args: calls.append(args.real_steps) or [{"run": "static"}])
    monkeypatch.setattr(eplb.eplb_real, "print_table", lambda rows: calls.append(rows))
    assert eplb.main(["--part", "real", "--real-steps", "7", "--json", str(out)]) == 0
    assert calls == [7, [{"run": "static"}]] and json.loads(out.read_text()) == {"real": [{"run": "static"}]}


@pytest.mark.slow      # ~5 s on an idle machine, ~20 s while others share the 2 cores
def test_attention_benchmark_quick_measures_every_mask_kind_against_the_math_kernel(monkeypatch, tmp_path, capsys):
    attention = _benchmark("attention", monkeypatch)
    out = tmp_path / "attention.json"
    assert attention.main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {row["kind"]: row for row in results["rows"]}
    assert set(rows) == set(attention.KINDS) and "peak/math" in capsys.readouterr().out
    for kind, row in rows.items():
        assert row["time_over_math"] == pytest.approx(row["chosen"]["min_s"] / row["math"]["min_s"])
        assert row["peak_over_math"] == pytest.approx(row["chosen"]["peak_bytes"] / row["math"]["peak_bytes"])
        # CPU: enable_gqa on the flash kernel, but each query head has its own sink key
        assert row["fused"] and row["kv_heads_expanded"] == (kind == "sinks")
    # In training the fused kernel allocates under the math kernel's [B, Hq, Sq, Sk] scores and
    # probabilities: well under, but for the sinks' expanded, widened q / k / v copies (O(S Hq D), at
    # S = 128 near the scores' size)
    assert all(row["peak_over_math"] < (1 if kind == "sinks" else 0.5) for kind, row in rows.items()
               if row["training"])


@pytest.mark.parametrize("name", ["attention", "checkpoint_load", "convert", "decode", "eplb", "fp8_experts",
                                  "layout_plan", "memory", "moe_layer", "scaling", "serving_dp", "train_step"])
def test_benchmark_help_shows_its_whole_description_and_every_default(name, monkeypatch, capsys):
    import argparse

    module = _benchmark(name, monkeypatch)
    parsers = []
    parse_args = argparse.ArgumentParser.parse_args

    def recording_parse_args(parser, *args, **kwargs):
        parsers.append(parser)
        return parse_args(parser, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse_args)
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    shown = "".join(capsys.readouterr().out.split())      # argparse wraps lines, at hyphens too
    assert "".join(module.__doc__.split()) in shown, "the description is cut"
    options = [a for a in parsers[0]._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        assert action.help, f"{action.option_strings} has no help"
        # Shown unless there is nothing to show: no default, an on/off flag, a help naming its default.
        if action.default is not None and not isinstance(action.default, bool) and "default" not in action.help:
            assert f"(default:{action.default})".replace(" ", "") in shown, action.option_strings


@pytest.mark.slow      # ~10 s: 2 gloo ranks, 4 steps per run
def test_eplb_real_benchmark_rebalances_and_writes_its_table(monkeypatch, tmp_path, capsys):
    eplb_real = _benchmark("eplb_real", monkeypatch)
    out = tmp_path / "eplb_real.json"
    assert eplb_real.main(["--real-ranks", "2", "--real-steps", "4", "--real-interval", "2", "--real-window", "2",
                           "--json", str(out)]) == 0
    rows = {row["run"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"static", "eplb"} and rows["static"]["rebalances"] == 0
    eplb = rows["eplb"]
    assert eplb["rebalances"] == 2 and eplb["moved_slots"] > 0 and eplb["moved_bytes"] > 0
    assert eplb["rebalancing_over_normal"] == pytest.approx(eplb["rebalancing_step_s"] / eplb["normal_step_s"])
    assert len(eplb["balancedness_by_step"]) == 4 and "balancedness over time" in capsys.readouterr().out


def test_memory_benchmark_lora_rows_scale_with_the_adapters(monkeypatch, tmp_path, capsys):
    """--lora-only (one process): full fine-tuning, then LoRA ranks 8 and 16; the adapters' optimizer state is
    linear in the rank and a fraction of the full run's (the 5% target is the real model's: the quick one is
    too narrow, and its verdict says so)."""
    memory = _benchmark("memory", monkeypatch)
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--lora-only", "--lora-ranks", "8", "16", "--json", str(out)]) == 0
    lora = json.loads(out.read_text())["lora"]
    full, r8, r16 = lora["rows"]
    assert full["lora_rank"] is None and full["opt_ratio"] == 1 and full["trainable"] == full["params"]
    # the moments double with the rank; AdamW's step counters (4 bytes per tensor) do not
    assert 0 < 2 * r8["opt"] - r16["opt"] < 0.01 * r16["opt"] and r16["opt_ratio"] < 1
    assert r16["trainable"] == 2 * r8["trainable"] and r16["trainable"] < full["params"]
    verdicts = {v["target"]: v for v in lora["verdicts"]}
    assert verdicts["quick: LoRA optimizer state scales with the adapters (rank r: r / 16 of rank 16's, within 1%)"]["met"]
    rank16 = verdicts["quick: LoRA rank 16 optimizer state <= 5% of full fine-tuning's"]
    assert rank16["figures"]["ratio"] == pytest.approx(r16["opt_ratio"])
    assert "LoRA (one process" in capsys.readouterr().out


@pytest.mark.slow      # ~25 s: one spawn of 4 gloo ranks, 13 runs of a tiny model and 2 checkpoint runs
def test_memory_benchmark_quick_measures_every_layout_beside_the_estimate(monkeypatch, tmp_path, capsys):
    memory = _benchmark("memory", monkeypatch)
    out = tmp_path / "memory.json"
    layouts = ["tp2_sp_ep2", "pp2_ep2", "tp2_ep2"]       # sequence and pipeline parallelism, the SP baseline
    assert memory.main(["--quick", "--layouts", *layouts, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    runs = {(r["layout"], r["recompute"], r["optimizer"]) for r in rows}
    assert runs == set(memory._runs(layouts, memory.RECOMPUTE, memory.OPTIMIZERS))
    assert {r["stage"] for r in rows if r["layout"] == "pp2_ep2"} == {0, 1}
    for r in rows:
        # State bytes are exact; every measured column is there, beside its estimate and the ratio.
        assert (r["param"], r["grad"], r["opt"]) == (r["estimate"]["param"], r["estimate"]["grad"],
                                                    r["estimate"]["opt"]), r
        assert 0 < r["act"] <= r["act_max"] and r["act"] < r["peak"] <= r["peak_max"], r
        assert r["ratio"]["act"] == pytest.approx(r["act"] / r["estimate"]["act"])
        assert 0.85 < r["ratio"]["act"] < 1.15, r
    verdicts = {v["target"]: v for v in results["verdicts"]}
    shown = capsys.readouterr().out
    assert all(("PASS: " if v["met"] else "FAIL: ") + target in shown for target, v in verdicts.items())
    sp = verdicts["sequence parallelism at TP 2 halves the norm/residual activation bytes"]
    assert sp["met"] and sp["figures"]["ratio"] == pytest.approx(0.5)
    assert verdicts["pp2_ep2: full recompute saves >= 70% of the saved-activation bytes of none"]["met"]
    assert "pp2_ep2: selective recompute saves >= 25% of the saved-activation bytes of none" in verdicts
    assert all(v["met"] for t, v in verdicts.items() if "optimizer state" in t)
    assert [r["recompute"] for r in results["deepseek_v3"]["rows"]].count("full") == len(memory.OPTIMIZER_CHOICES)
    # ZeRO checkpoints: every layout but the SP baseline, every stage; the optimizer's side of a save and a
    # load now holds at most one bucket on the device, where it held the full state before.
    checkpoints = results["checkpoints"]["rows"]
    assert {(r["layout"], r["stage"]) for r in checkpoints} == {("tp2_sp_ep2", 0), ("pp2_ep2", 0), ("pp2_ep2", 1)}
    for r in checkpoints:
        assert r["buckets"] > 4 and r["ratio"]["bucket"] < 0.5, r
        assert r["ratio"]["save_before"] >= 1 and r["ratio"]["load_before"] >= 1, r
        assert 0 < r["save_now"] <= r["bucket"] + 2 * r["param"] and 0 <= r["load_now"] <= r["bucket"], r
        assert r["ratio"]["save_now"] == pytest.approx(r["save_now"] / r["full_state"])
    assert all(v["met"] for t, v in verdicts.items() if "ZeRO checkpoint" in t) and "ZeRO-1 checkpoint" in shown


@pytest.mark.slow      # ~15 s while others share the 2 cores: one spawn of 4 gloo ranks, 2 layouts x overlap off / on
def test_scaling_benchmark_quick_reports_every_layout_with_overlap_off_and_on(monkeypatch, tmp_path, capsys):
    from megamoe.models import GPTMoEModel
    from megamoe.pipeline.schedule_simulation import simulate_pipeline
    from parallel_state import ParallelState
    scaling = _benchmark("scaling", monkeypatch)
    out = tmp_path / "scaling.json"
    layouts = ["dp4", "pp2_v2_ep2"]          # data parallel; interleaved pipeline with EP all-to-alls
    assert scaling.main(["--quick", "--layouts", *layouts, "--steps", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    m = results["model"]
    rows = {(r["layout"], r["overlap"]): r for r in results["rows"]}
    assert set(rows) == {(name, mode) for name in layouts for mode in ("off", "on")}
    shown = capsys.readouterr().out
    assert "CHECK FAILED" not in shown and all(name in shown for name in layouts)
    for name in layouts:
        off, on = rows[(name, "off")], rows[(name, "on")]
        # The oracle of overlap is the run without it: the same losses bit for bit, the same collectives.
        assert on["losses_bit_identical"] and on["bytes_equal"], name
        assert on["losses"] == off["losses"] and len(on["losses"]) == 3, name
        assert on["bytes_per_step"] == off["bytes_per_step"], name
        for r in (off, on):
            assert len(r["step_times_s"]) == 2 and r["min_s"] == min(r["step_times_s"]), name
            assert r["tokens_per_s"] == pytest.approx(m["batch"] * m["seq"] / r["min_s"])
            simulated = simulate_pipeline(r["pp"], r["micro_batches"], r["v"]).mean_bubble_fraction
            assert r["bubble_simulated"] == (0.0 if r["pp"] == 1 else simulated), name
        assert on["on_over_off_min"] == pytest.approx(on["min_s"] / off["min_s"])
        for tag, fraction in on["overlapped_fraction"].items():
            raw = on["overlapped_fraction_raw"][tag]
            assert (fraction is None) == (raw is None), (name, tag)
            if fraction is not None:
                assert 0.0 <= fraction <= 1.0 and fraction == min(1.0, max(0.0, raw)), (name, tag)
        # Every run waited for its gradient buckets; only EP layouts have MoE all-to-alls to wait for.
        assert on["overlapped_fraction"]["grad_bucket"] is not None, name
        assert (on["overlapped_fraction"]["moe_all_to_all"] is None) == (name == "dp4"), name
    dp4, pp = rows[("dp4", "off")], rows[("pp2_v2_ep2", "off")]
    # dp4: every gradient all-reduced once (4 bytes a parameter; the loss metrics add a few bytes), no other traffic.
    params = sum(p.numel() for p in GPTMoEModel(scaling.model_config(m, {}, overlap=False),
                                                ParallelState.single_process()).parameters())
    assert 4 * params <= dp4["bytes_per_step"]["all_reduce"] < 4 * params + 1024
    assert dp4["bytes_per_step"]["all_to_all"] == dp4["bytes_per_step"]["send"] == 0 == dp4["bubble_measured"]
    # pp 2 x V 2: 2 (pp V - 1) transfers of a [1, S, H] fp32 tensor per micro-batch, over the pp ranks.
    transfers = 2 * (pp["pp"] * pp["v"] - 1) / pp["pp"] * pp["micro_batches"]
    assert pp["bytes_per_step"]["send"] == pp["bytes_per_step"]["recv"] == transfers * m["seq"] * m["hidden"] * 4
    assert pp["bytes_per_step"]["all_to_all"] > 0 and 0 < pp["bubble_measured"] < 1


@pytest.mark.slow      # ~3-8 s on one thread: a tiny model, every system once, fp32 and bf16
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("one_thread")     # two threads on the busy 2-core machine: tiny steps ~10x slower
def test_serving_benchmark_tiny(monkeypatch, tmp_path):
    serving = _benchmark("serving", monkeypatch)
    out = tmp_path / "serving.json"
    assert serving.main(["--tiny", "--models", "qwen3_moe", "--scenarios", "offline", "shared_prefix", "--bf16",
                         "--json", str(out)]) == 0
    results = json.loads(out.read_text())["models"]["qwen3_moe"]
    offline = results["scenarios"]["offline"]["rows"]
    assert set(offline) == {"hf/cb", "hf/static-4", "hf/static-8", "megamoe/static-4", "megamoe/static-8", "engine",
                            "engine/no-prefix"}
    for name, row in offline.items():
        assert row["same_ids"] == 1.0, f"{name} generated other tokens than generate()"
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["peak_kv_bytes"] > 0, name
    assert len({row["output_tokens"] for row in offline.values()}) == 1      # every system: every request's tokens
    verdicts = results["verdicts"]
    best = verdicts["offline_over_best_static"]
    assert best["value"] == pytest.approx(offline["engine"]["output_tokens_per_s"]
                                          / offline[best["against"]]["output_tokens_per_s"])
    shared = results["scenarios"]["shared_prefix"]["rows"]
    assert verdicts["shared_prefix_prefill_cut"]["value"] == pytest.approx(
        shared["engine/no-prefix"]["prompt_tokens_computed"] / shared["engine"]["prompt_tokens_computed"])
    assert shared["engine"]["prefix_cache_hit_tokens"] > 0
    bf16 = results["scenarios"]["offline_bf16"]["rows"]         # the same weights in bf16, each static at its best
    batches = {kind: max((r for n, r in offline.items() if n.startswith(kind + "/static-")),
                         key=lambda r: r["output_tokens_per_s"])["batch"] for kind in ("hf", "megamoe")}
    assert set(bf16) == {f"hf/static-{batches['hf']}", f"megamoe/static-{batches['megamoe']}", "engine"}
    assert all(row["output_tokens"] == offline["engine"]["output_tokens"] for row in bf16.values())
    assert bf16[f"megamoe/static-{batches['megamoe']}"]["same_ids"] == 1.0     # its own reference
    assert bf16["engine"]["peak_kv_bytes"] * 2 == offline["engine"]["peak_kv_bytes"]
    best16 = verdicts["offline_bf16_over_best_static"]
    assert best16["value"] == pytest.approx(bf16["engine"]["output_tokens_per_s"]
                                            / bf16[best16["against"].split()[0]]["output_tokens_per_s"])



@pytest.mark.slow      # ~5 s of CPU: 2 gloo ranks, a tiny model, 4 requests of 2 tokens, each system twice
def test_serving_dp_benchmark_quick(monkeypatch, tmp_path, capsys):
    serving_dp = _benchmark("serving_dp", monkeypatch)
    out = tmp_path / "serving_dp.json"
    assert serving_dp.main(["--quick", "--requests", "4", "--new-tokens", "2", "--repeats", "1",
                            "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert set(rows) == {"replicated attention", "data-parallel attention"}
    replicated, data_parallel = rows["replicated attention"], rows["data-parallel attention"]
    # Replicated: both ranks compute every token; data-parallel attention: each its own requests' (all of them).
    assert replicated["tokens_computed_per_rank"][0] == replicated["tokens_computed_per_rank"][1]
    assert sum(data_parallel["tokens_computed_per_rank"]) == replicated["tokens_computed_per_rank"][0]
    assert min(data_parallel["tokens_computed_per_rank"]) > 0
    assert results["verdicts"]["dp_attention_tokens_per_s_over_replicated"] == pytest.approx(
        replicated["min_s"] / data_parallel["min_s"])
    assert "data-parallel attention / replicated" in capsys.readouterr().out


@pytest.mark.slow      # ~1-2 s: a tiny DeepSeek-V3 trained 15 steps, 2 requests at batch 1 with and without MTP
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("one_thread")
def test_serving_benchmark_mtp_drafts_of_the_trained_model_are_accepted(monkeypatch, tmp_path):
    """The DeepSeek-V3-like model trained on the structured corpus (main and MTP losses) drafts tokens the engine
    accepts (with its random MTP weights, none were: acceptance 0.00); the trained weights are cached, and a
    model built again reads them, transformers' copy included."""
    serving = _benchmark("serving", monkeypatch)
    out, cache = tmp_path / "serving.json", tmp_path / "cache"
    assert serving.main(["--tiny", "--models", "deepseek_v3", "--scenarios", "mtp", "--train-cache", str(cache),
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())["models"]["deepseek_v3"]
    rows = result["scenarios"]["mtp_batch1"]["rows"]
    assert rows["engine"]["same_ids"] == rows["engine/mtp"]["same_ids"] == 1.0
    assert rows["engine/mtp"]["spec_proposed"] > 0 and rows["engine/mtp"]["acceptance_rate"] >= 0.5
    assert result["training"]["last_loss"] < result["training"]["first_loss"] / 2
    assert result["verdicts"]["mtp_decode_speedup"]["value"] == pytest.approx(
        rows["engine/mtp"]["decode_tokens_per_s"] / rows["engine"]["decode_tokens_per_s"])
    hf, model = serving.build_models("deepseek_v3", serving.TINY, 0)
    info = serving.train_on_corpus(hf, model, "deepseek_v3", result["training"]["steps"], 0,
                                   result["training"]["alphabet"], str(cache))
    assert info["cached"].startswith(str(cache))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(model(ids)[0], hf(ids).logits, atol=1e-4)
