"""examples/custom_layers.py (docs/design.md's subclassing example): a parameter declared with
shard_parameter is checkpointed as one logical tensor, so the gated MLP trained at TP 2 reloads at TP 1
with the same loss, and trains on the single-process loss and gradient-norm curve."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megamoe.checkpoint.format import read_manifest
from megamoe.sharding import ShardSpec, get_shard_spec
from megamoe.spawned_ranks import run_on_ranks
from parallel_state import ParallelState

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
import custom_layers  # noqa: E402  (examples/ is no package)

GATE = "layers.0.mlp.up.gate"
FFN = custom_layers.model_config().dense_mlp.intermediate_size


def _close(got, want):
    return abs(got - want) <= custom_layers.REL_TOL * abs(want)


def _train_at_tp2_reload_at_tp1(rank, world_size, directory):
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    torch.set_num_threads(1)
    state = initialize_model_parallel(tp=2)
    trainer = custom_layers.build_trainer(state, dist.group.WORLD)
    gate = trainer.model.layers["0"].mlp.up.gate
    spec = get_shard_spec(gate)
    metrics = custom_layers.train(trainer, 5)
    custom_layers.save_training_checkpoint(directory, trainer, sampler_state=None, world_group=dist.group.WORLD)
    trained = custom_layers.evaluation_loss(trainer.model)
    gate_values = gate.detach().tolist()     # plain values: a tensor would outlive its rank in shared memory
    destroy_model_parallel()
    state = initialize_model_parallel(tp=1)                          # TP 1 x DP 2
    reloaded = custom_layers.reload_and_evaluate(state, dist.group.WORLD, directory)
    destroy_model_parallel()
    return dict(spec=spec, curve=[(m.loss, m.grad_norm) for m in metrics], trained=trained, reloaded=reloaded,
                gate=gate_values)


@pytest.mark.slow
def test_gated_mlp_trained_at_tp2_reloads_at_tp1_with_the_same_loss(tmp_path):
    directory = tmp_path / "checkpoint"
    ranks = run_on_ranks(_train_at_tp2_reload_at_tp1, 2, args=(str(directory),), timeout_s=600)
    for rank, result in enumerate(ranks):
        assert result["spec"] == ShardSpec((FFN,), 0, rank, 2)

    torch.set_num_threads(1)
    single = ParallelState.single_process()
    reference = custom_layers.build_trainer(single, None)
    reference_curve = [(m.loss, m.grad_norm) for m in custom_layers.train(reference, 5)]
    assert reference_curve[-1][0] < reference_curve[0][0], "the loss must fall"
    for (loss, norm), (want_loss, want_norm) in zip(ranks[0]["curve"], reference_curve):
        # The gradient norm counts each gate chunk once (as TP-replicated it would count half of it).
        assert _close(loss, want_loss) and _close(norm, want_norm), (ranks[0]["curve"], reference_curve)

    stored = read_manifest(directory)["tensors"][GATE]
    assert stored["global_shape"] == [FFN] and len(stored["chunks"]) == 2      # one logical gate, a chunk per rank
    full_gate = torch.tensor(ranks[0]["gate"] + ranks[1]["gate"])
    assert not torch.equal(full_gate, torch.ones(FFN)), "the gate must have trained"
    single_trainer = custom_layers.build_trainer(single, None)         # and reload in this process, TP 1
    custom_layers.load_training_checkpoint(directory, single_trainer, world_group=None)
    assert torch.equal(single_trainer.model.layers["0"].mlp.up.gate.detach(), full_gate)
    for result in ranks:
        assert _close(result["reloaded"], result["trained"]), result
        assert _close(custom_layers.evaluation_loss(single_trainer.model), result["trained"])


@pytest.mark.slow
def test_the_example_script_runs_single_process(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "custom_layers.py"), "--dir", str(tmp_path / "c"),
                          "--steps", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "reloaded at TP 1" in out.stdout


def test_the_example_script_refuses_bad_steps_with_one_error_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "custom_layers.py"), "--dir", str(tmp_path / "c"),
                          "--steps", "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["custom_layers.py: error: --steps must be >= 1, got 0"]
    assert not (tmp_path / "c").exists()
