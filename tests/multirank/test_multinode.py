"""Multi-node runs and restarts (docs/multinode.md): SIGTERM / Ctrl-C stop a run at the next step boundary with
a checkpoint and exit code 0 (every rank agrees on the step; a second signal while saving is ignored) and the
same command resumes it identically; two torchrun agents on one machine (``--nnodes 2``, c10d rendezvous)
train exactly as one node with the same ranks; ``torchrun --max-restarts`` after a killed rank resumes the
newest intact checkpoint by itself; the SLURM example's torchrun line parses and uses existing flags."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamoe.cli import train
from megamoe.cli.launch import run_script
from megamoe.training import pretrain as pretrain_module
from megamoe.training.checkpoint import list_checkpoints
from megamoe.training.preemption import StopSignals

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
# A tiny run: tokenizer and model of a few seconds; no evaluation but at the end, no samples.
TINY_CONFIG = """\
[model]
hidden = 32
layers = 2
vocab_size = 512
[data]
corpus_bytes = 200000
seq_len = 32
[schedule]
global_batch = 4
micro_batch = 1
eval_every = 1000
eval_iters = 1
[logging]
sample_tokens = 0
progress = false
"""
# Multi-rank runs: generous limits for a loaded 2-core machine (they end in seconds to minutes).
RUN_LIMIT_S = 900


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_CONFIG)
    return path


def _losses(log_json: Path) -> dict[int, float]:
    """Step -> loss of a run's JSON log (a restarted or resumed run appends; the last record of a step wins).
    Read while the run writes it, a last line without its newline is not complete yet: left out."""
    losses = {}
    for line in log_json.read_text().split("\n")[:-1] if log_json.exists() else []:
        record = json.loads(line)
        if "loss" in record and "step" in record:
            losses[record["step"]] = record["loss"]
    return losses


# ---------------------------------------------------------------------------------------------- one process


def test_stop_signals_records_the_first_signal_ignores_later_ones_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        assert not stop.agreed(None, "cpu")
        os.kill(os.getpid(), signal.SIGTERM)        # would end pytest without the handler
        os.kill(os.getpid(), signal.SIGINT)         # would raise KeyboardInterrupt
        assert stop.received == signal.SIGTERM and stop.ignored == 1
        assert stop.agreed(None, "cpu") and stop.reason() == "SIGTERM"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_each_torchrun_attempt_has_its_own_store_keys(monkeypatch):
    """A restarted job (--max-restarts) shares the agent's store with the killed attempt: the process group
    of attempt 1 must not read attempt 0's keys (the killed ranks' addresses)."""
    import datetime
    import torch.distributed as dist
    from megamoe.process_group import _restart_store_options
    timeout = datetime.timedelta(seconds=30)
    agent_store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _restart_store_options(timeout) == {}            # plain env:// rendezvous
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores = {}
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        options = _restart_store_options(timeout)
        assert (options["rank"], options["world_size"]) == (0, 1)
        stores[attempt] = options["store"]
    stores["0"].set("rank_0_address", "killed")
    stores["1"].set("rank_0_address", "restarted")
    assert stores["0"].get("rank_0_address") == b"killed" and stores["1"].get("rank_0_address") == b"restarted"


def _argv(tmp_path, name, steps, config, save_every=100):
    return ["--config", str(config), "--work-dir", str(tmp_path / "work"), "--save-dir", str(tmp_path / name),
            "--log-json", str(tmp_path / f"{name}.jsonl"), "--steps", str(steps), "--save-every", str(save_every),
            "--device", "cpu"]


def test_sigterm_saves_at_the_next_step_boundary_exits_0_and_resumes_identically(tmp_path, monkeypatch):
    """One process: SIGTERM during step 2, then Ctrl-C while the checkpoint is written: the step finishes,
    step 2 is saved intact (no step 2 checkpoint is due: --save-every 100), the command returns 0, and
    running it again continues exactly as a run that was never stopped."""
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    config = _config(tmp_path)
    assert run_script(train.main, _argv(tmp_path, "reference", 4, config)) == 0

    real_step, real_save = pretrain_module.Trainer.train_step, pretrain_module.save_training_checkpoint
    saves = []

    def step_then_signal(trainer, micro_batches):
        metrics = real_step(trainer, micro_batches)
        if metrics.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)    # arrives during the step's last bytecodes
        return metrics

    def save_with_ctrl_c(path, *args, **kwargs):
        saves.append(os.path.basename(path))
        os.kill(os.getpid(), signal.SIGINT)         # a second signal while saving
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(pretrain_module.Trainer, "train_step", step_then_signal)
    monkeypatch.setattr(pretrain_module, "save_training_checkpoint", save_with_ctrl_c)
    assert run_script(train.main, _argv(tmp_path, "stopped", 4, config)) == 0
    assert saves == ["step_00000002"]
    assert [step for step, _ in list_checkpoints(tmp_path / "stopped")] == [2]
    assert not list((tmp_path / "stopped").glob("*.tmp-*"))
    assert sorted(_losses(tmp_path / "stopped.jsonl")) == [1, 2]

    monkeypatch.setattr(pretrain_module.Trainer, "train_step", real_step)
    monkeypatch.setattr(pretrain_module, "save_training_checkpoint", real_save)
    assert run_script(train.main, _argv(tmp_path, "stopped", 4, config)) == 0
    assert _losses(tmp_path / "stopped.jsonl") == _losses(tmp_path / "reference.jsonl")


# ---------------------------------------------------------------------------------------- torchrun jobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Job:
    """A torchrun agent in its own process group, its output in a file; killed with its workers on exit."""

    def __init__(self, torchrun_flags, train_argv, cwd: Path, log: Path):
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun_flags, "-m", "megamoe", "train", *train_argv],
            cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun did not end in {RUN_LIMIT_S} s:\n{self.output()[-3000:]}")

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of the agent's worker processes (its children) now running."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        ranks = {}
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue            # ended meanwhile
            rank = next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[rank] = pid
        return ranks

    def kill(self) -> None:
        """End the agent and its workers (torchrun starts each worker in a session of its own: the agent's
        process group does not reach them)."""
        if self.process.poll() is None:
            for pid in self.workers().values():
                with contextlib.suppress(ProcessLookupError):       # ended meanwhile
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _wait_for(condition, job: _Job, what: str):
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if job.process.poll() is not None:
            pytest.fail(f"torchrun ended (exit {job.process.returncode}) before {what}:\n{job.output()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {what} after {RUN_LIMIT_S} s:\n{job.output()[-3000:]}")


@pytest.fixture
def jobs():
    started = []
    yield lambda *args: started.append(_Job(*args)) or started[-1]
    for job in started:
        job.kill()


def _rdzv(port: int, nnodes: int, nproc: int, *extra: str) -> list[str]:
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}", "--local-addr", "127.0.0.1", *extra]


@pytest.mark.slow
@pytest.mark.multirank
def test_two_agents_on_one_machine_train_as_one_node(tmp_path, jobs):
    """Two torchrun agents (--nnodes 2 x 2 ranks, c10d rendezvous on 127.0.0.1) both finish, their loss curve
    is that of one 4-rank node, and the checkpoint is written once (by the job, not per agent)."""
    config = _config(tmp_path)
    port = _free_port()
    agents = [jobs(_rdzv(port, 2, 2), _argv(tmp_path, "two_nodes", 3, config), tmp_path, tmp_path / f"agent{i}.log")
              for i in range(2)]
    for agent in agents:
        assert agent.wait() == 0, agent.output()[-3000:]
    assert "world 4:" in agents[0].output() + agents[1].output()
    one_node = jobs(_rdzv(_free_port(), 1, 4), _argv(tmp_path, "one_node", 3, config), tmp_path, tmp_path / "one.log")
    assert one_node.wait() == 0, one_node.output()[-3000:]
    two, one = _losses(tmp_path / "two_nodes.jsonl"), _losses(tmp_path / "one_node.jsonl")
    assert sorted(two) == [1, 2, 3] and two == one
    assert [step for step, _ in list_checkpoints(tmp_path / "two_nodes")] == [3]
    assert not list((tmp_path / "two_nodes").glob("*.tmp-*"))
    saved_lines = [line for agent in agents for line in agent.output().splitlines() if "pretrain: saved " in line]
    assert len(saved_lines) == 1, saved_lines


@pytest.mark.slow
@pytest.mark.multirank
def test_a_killed_rank_restarts_from_the_newest_checkpoint_and_sigterm_stops_cleanly(tmp_path, jobs):
    """torchrun --max-restarts 1, 2 ranks: SIGKILL rank 1 after the first checkpoint; the job restarts and
    resumes the newest intact checkpoint (not a half-written one) by itself. SIGTERM to one rank of the
    restarted job: both ranks stop at the same step with a checkpoint, exit 0. The same command then finishes
    the run; every step's loss equals the uninterrupted run's."""
    config = _config(tmp_path)
    steps = 40

    def argv(name):
        return _argv(tmp_path, name, steps, config, save_every=5)

    reference = jobs(_rdzv(_free_port(), 1, 2), argv("reference"), tmp_path, tmp_path / "reference.log")
    assert reference.wait() == 0, reference.output()[-3000:]

    save_dir = tmp_path / "restarted"
    job = jobs(_rdzv(_free_port(), 1, 2, "--max-restarts", "1"), argv("restarted"), tmp_path, tmp_path / "job.log")
    _wait_for(lambda: list_checkpoints(save_dir), job, "a first checkpoint")
    # What a save killed mid-way leaves (a temporary directory), and a step folder missing its manifest.
    (save_dir / "step_00000099.tmp-killed").mkdir()
    (save_dir / "step_00000099.tmp-killed" / "manifest.json").write_text("{")
    (save_dir / "step_00000098").mkdir()
    first = _wait_for(job.workers, job, "the workers")
    os.kill(first[1], signal.SIGKILL)
    logged_before_the_kill = max(_losses(tmp_path / "restarted.jsonl"), default=0)
    resumed = _wait_for(lambda: re.search(r"resuming from (\S+) at step (\d+)", job.output()), job, "the restart")
    assert re.fullmatch(r".*/step_\d{8}", resumed.group(1)) and int(resumed.group(2)) % 5 == 0
    workers = _wait_for(lambda: (w := job.workers()) and set(w.values()).isdisjoint(first.values()) and w,
                        job, "the restarted workers")
    # A step the restarted attempt trained (the killed attempt logged steps past the resumed one too): its stop
    # handlers are installed by then, so the SIGTERM is the one it handles, not the default action.
    _wait_for(lambda: max(_losses(tmp_path / "restarted.jsonl"), default=0) > max(logged_before_the_kill,
                                                                                int(resumed.group(2))), job,
              "a step after the restart")
    os.kill(workers[0], signal.SIGTERM)             # one rank only: the other stops at the same step
    assert job.wait() == 0, job.output()[-3000:]
    stopped = re.search(r"SIGTERM: stopped at step (\d+)", job.output())
    assert stopped, job.output()[-3000:]
    stopped_step = int(stopped.group(1))
    assert stopped_step < steps, "the run ended before the signal: nothing was tested"
    assert list_checkpoints(save_dir)[-1][0] == stopped_step
    assert max(_losses(tmp_path / "restarted.jsonl")) == stopped_step

    again = jobs(_rdzv(_free_port(), 1, 2), argv("restarted"), tmp_path, tmp_path / "again.log")
    assert again.wait() == 0, again.output()[-3000:]
    assert f"at step {stopped_step}" in again.output()
    assert _losses(tmp_path / "restarted.jsonl") == _losses(tmp_path / "reference.jsonl")
    assert sorted(_losses(tmp_path / "reference.jsonl")) == list(range(1, steps + 1))


# ---------------------------------------------------------------------------------------------- SLURM


def test_the_slurm_example_parses_and_its_torchrun_line_uses_existing_flags(tmp_path):
    """bash -n; then the script run with stand-ins for srun and scontrol: the torchrun command it starts
    parses with torchrun's own parser (c10d rendezvous on the first node, restarts) and its megamoe flags
    with megamoe train's."""
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    stubs, recorded = tmp_path / "bin", tmp_path / "srun_argv"
    stubs.mkdir()
    (stubs / "srun").write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {recorded}\n")
    (stubs / "scontrol").write_text("#!/bin/bash\necho node-a; echo node-b\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    slurm = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77",
             "SLURM_GPUS_ON_NODE": "8", "PATH": f"{stubs}:{os.environ['PATH']}"}
    config = REPO / "configs" / "demo.toml"
    result = subprocess.run(["bash", str(SBATCH), str(config)], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, **slurm})
    assert result.returncode == 0, result.stderr
    words = recorded.read_bytes().decode().split("\0")[:-1]
    torchrun_args = words[words.index("torchrun") + 1:]
    from torch.distributed.run import get_args_parser
    torchrun = get_args_parser().parse_args(torchrun_args)
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend, torchrun.rdzv_endpoint,
            torchrun.rdzv_id) == ("2", "8", "c10d", "node-a:29500", "77")
    assert torchrun.module and torchrun.training_script == "megamoe" and torchrun.max_restarts >= 1
    subcommand, *flags = torchrun.training_script_args
    assert subcommand == "train"
    args = train.parse_args(flags)          # an unknown flag or a bad config exits here
    assert args.config == config and args.device == "cuda"
