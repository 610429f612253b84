"""te_lab under torch.distributed on the CPU: two gloo ranks on 127.0.0.1.

One 2-rank session does everything the slow tests check, so each rank imports torch and
te_lab and loads the Inductor kernels once: this file, run as a script once per rank
with the variables torchrun sets (``te_lab.distributed.init_process_group`` reads
them), trains the fused tiny Llama for 10 AdamW steps, each rank on its half of every
global batch,

- under DDP, fused before wrapping, and wrapped before fusing (``te_lab.fuse(ddp)``);
- under FSDP2 (``fully_shard`` on each decoder layer and the root), fused before;

then profiles the DDP model (``te_lab.profile``, one report per rank). Each rank saves
what it saw to ``rank<r>.pt``; the tests compare it with plain single-process training
of the unfused model on the whole global batch. The session runs under a deadline: a
rank that fails or hangs ends it, and the others are killed.

The refusals (fusing a sharded model, unfusing a fused one after sharding) need no
second rank: a one-rank gloo group in this process shards the model.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import te_lab
from te_lab import models
from te_lab.profiler.communication import communication_ns
from te_lab.profiler.device_kernels import DeviceKernel
from te_lab.profiler.report import Environment, ModeSummary

WORLD_SIZE = 2
STEPS = 10
GLOBAL_BATCH, SEQ = 4, 32
LEARNING_RATE = 1e-3
SESSION_DEADLINE_S = 420  # a healthy session takes well under a minute; a hang must fail, not stall CI
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a rank stuck in a collective raises instead of waiting


def fully_shard_function():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5 has FSDP2 under its composable API only
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def global_batch(model, step: int) -> dict:
    return model.example_batch(batch=GLOBAL_BATCH, seq=SEQ, seed=step)


def rank_half(batch: dict, rank: int) -> dict:
    return {name: value.chunk(WORLD_SIZE)[rank] for name, value in batch.items()}


def train(model, batch_of_step) -> list:
    """STEPS AdamW steps of ``model`` on ``batch_of_step(step)``; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(STEPS):
        loss = model(**batch_of_step(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def full_state(model) -> dict:
    """Parameter name -> the whole tensor (FSDP2's shards gathered from every rank)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


# ---- the 2-rank session (each rank runs this file as a script) ---------------------------


def _mean_over_ranks(losses: list) -> list:
    # Both halves hold the same number of labelled tokens, so the mean of the ranks'
    # mean losses is the global batch's mean loss.
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return (stacked / WORLD_SIZE).tolist()


def _fused_count(report) -> int:
    return sum(row.status == "fused" for row in report.rows)


def _ddp_fused_then_wrapped(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = models.build_model("llama-tiny")
    report = te_lab.fuse(model, sample=rank_half(global_batch(model, 0), rank))
    ddp = DistributedDataParallel(model)
    losses = train(ddp, lambda step: rank_half(global_batch(model, step), rank))
    return dict(model=ddp, fused=_fused_count(report), losses=_mean_over_ranks(losses), state=full_state(model))


def _ddp_wrapped_then_fused(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = models.build_model("llama-tiny")
    ddp = DistributedDataParallel(model)
    report = te_lab.fuse(ddp, sample=rank_half(global_batch(model, 0), rank))
    losses = train(ddp, lambda step: rank_half(global_batch(model, step), rank))
    state, is_fused = full_state(model), te_lab.is_fused(model)
    batch = rank_half(global_batch(model, STEPS), rank)
    fused_loss = ddp(**batch).loss.detach()
    restored = te_lab.unfuse(ddp).restored
    unfused_loss = ddp(**batch).loss  # DDP runs the originals, on the weights trained fused
    unfused_loss.backward()
    return dict(fused=_fused_count(report), is_fused=is_fused, report_model=report.model_type,
                losses=_mean_over_ranks(losses), state=state, restored=len(restored),
                loss_fused_unfused=(fused_loss.item(), unfused_loss.item()))


def _fsdp2_fused_then_sharded(rank: int) -> dict:
    fully_shard = fully_shard_function()
    model = models.build_model("llama-tiny")
    report = te_lab.fuse(model, sample=rank_half(global_batch(model, 0), rank))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses = train(model, lambda step: rank_half(global_batch(model, step), rank))
    return dict(fused=_fused_count(report), is_fused=te_lab.is_fused(model),
                sharded=te_lab.distributed.sharded_parameter(model), losses=_mean_over_ranks(losses),
                state=full_state(model))


def _profile_ddp(ddp, rank: int, out: Path) -> dict:
    batch = rank_half(global_batch(ddp.module, 0), rank)
    ddp(**batch).loss.backward()  # gradients the profile must leave as they are
    before = [p.grad.clone() for p in ddp.parameters()]
    report = te_lab.profile(ddp, batch, steps=2, warmup=1)
    after = [p.grad for p in ddp.parameters()]
    return dict(path=str(report.save(out / "report.json")), summary=report.summary(),
                grads_unchanged=all(torch.equal(a, b) for a, b in zip(before, after)))


def _session(out: Path) -> None:
    device = te_lab.distributed.init_process_group("cpu", timeout=COLLECTIVE_TIMEOUT)
    try:
        rank = dist.get_rank()
        results = dict(device=str(device), backend=dist.get_backend(), world_size=dist.get_world_size())
        results["ddp_fused_then_wrapped"] = _ddp_fused_then_wrapped(rank)
        results["ddp_wrapped_then_fused"] = _ddp_wrapped_then_fused(rank)
        results["fsdp2_fused_then_sharded"] = _fsdp2_fused_then_sharded(rank)
        results["profile"] = _profile_ddp(results["ddp_fused_then_wrapped"].pop("model"), rank, out)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# ---- the launcher and the tests ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_ranks(out: Path, port: int) -> list[subprocess.Popen]:
    """Start WORLD_SIZE ranks of this file as torchrun would and wait for them, under the
    deadline; a rank that fails ends the others."""
    ranks = []
    for rank in range(WORLD_SIZE):
        environment = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                           LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           OMP_NUM_THREADS="1")  # as torchrun sets it: the ranks share the cores
        with open(out / f"rank{rank}.log", "w") as log:
            ranks.append(subprocess.Popen([sys.executable, __file__, str(out)], env=environment, stdout=log,
                                          stderr=subprocess.STDOUT))
    deadline = time.monotonic() + SESSION_DEADLINE_S
    try:
        while any(r.poll() is None for r in ranks):
            if any(r.returncode not in (None, 0) for r in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for r in ranks:
            if r.poll() is None:
                r.kill()
                r.wait()
    return ranks


def _run_session(out: Path) -> list[dict]:
    """Each rank's results from a 2-rank session on a free port."""
    for attempt in range(2):
        ranks = _run_ranks(out, _free_port())
        logs = [(out / f"rank{rank}.log").read_text() for rank in range(WORLD_SIZE)]
        if all(r.returncode == 0 for r in ranks):
            return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
        if attempt == 0 and any("EADDRINUSE" in log for log in logs):
            continue  # another process took the free port before rank 0 listened on it
        break
    pytest.fail("the 2-rank session failed or passed its deadline (killed: exit code -9);\n"
                + "\n".join(f"rank {i} exit code {r.returncode}:\n{log[-4000:]}"
                             for i, (r, log) in enumerate(zip(ranks, logs))))


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> list[dict]:
    return _run_session(tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="module")
def single_process() -> dict:
    """The reference: the unfused model, one process, the whole global batch each step."""
    model = models.build_model("llama-tiny")
    losses = train(model, lambda step: global_batch(model, step))
    return dict(losses=[loss.item() for loss in losses], state=full_state(model))


def _assert_trains_like_single_process(run: dict, reference: dict) -> None:
    # float32, absolute. The ranks' fused kernels (Inductor C++ on the CPU) and the
    # all-reduce sum in other orders than one unfused process does (the fusion probes see
    # gradient differences up to ~3e-5 of a gradient's scale). After 10 AdamW steps (lr
    # 1e-3, so every weight moved by up to ~1e-2) the weights agree to ~5e-6 and the
    # losses to ~5e-7 here; 2e-5 leaves room for other CPUs' summation orders and stays
    # ~1000x below the drift of one rank training on its half alone (checked in
    # test_the_comparison_tells_a_rank_alone_from_the_whole_batch).
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=0, atol=2e-5)
    assert run["state"].keys() == reference["state"].keys()
    for name, expected in reference["state"].items():
        torch.testing.assert_close(run["state"][name], expected, rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_the_comparison_tells_a_rank_alone_from_the_whole_batch(single_process):
    model = models.build_model("llama-tiny")
    alone = train(model, lambda step: rank_half(global_batch(model, step), 0))
    with pytest.raises(AssertionError):
        _assert_trains_like_single_process(dict(losses=[loss.item() for loss in alone], state=full_state(model)),
                                           single_process)


@pytest.mark.slow
def test_session_runs_two_gloo_ranks_on_the_cpu(session):
    for rank, results in enumerate(session):
        assert (results["device"], results["backend"], results["world_size"]) == ("cpu", "gloo", WORLD_SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["ddp_fused_then_wrapped", "ddp_wrapped_then_fused", "fsdp2_fused_then_sharded"])
def test_fused_model_trains_like_single_process(session, single_process, order):
    for results in session:
        run = results[order]
        assert run["fused"] == 10  # every candidate of the tiny Llama, the LM head's loss included
        _assert_trains_like_single_process(run, single_process)
    for name, tensor in session[0][order]["state"].items():  # the replicas (or gathered shards) agree exactly
        assert torch.equal(tensor, session[1][order]["state"][name]), name


@pytest.mark.slow
def test_fuse_and_unfuse_after_wrapping_reach_the_wrapped_model(session):
    run = session[0]["ddp_wrapped_then_fused"]
    assert run["is_fused"] and run["report_model"] == "LlamaLM"
    assert run["restored"] == 10  # te_lab.unfuse(ddp) puts every original back
    fused_loss, unfused_loss = run["loss_fused_unfused"]
    assert unfused_loss == pytest.approx(fused_loss, abs=1e-5)


@pytest.mark.slow
def test_fsdp2_trained_the_fused_model_sharded(session):
    run = session[0]["fsdp2_fused_then_sharded"]
    assert run["is_fused"] and run["sharded"] == "model.embed_tokens.weight"


@pytest.mark.slow
def test_profile_writes_one_report_per_rank_with_communication_apart(session):
    for rank, results in enumerate(session):
        path = Path(results["profile"]["path"])
        assert path.name == f"report.rank{rank}.json"
        report = te_lab.ProfileReport.from_json(path.read_text())
        assert (report.environment.rank, report.environment.world_size) == (rank, WORLD_SIZE)
        assert report.environment.target == "DistributedDataParallel(LlamaLM)"
        for mode in ("eager", "fused"):
            summary = report.modes[mode]
            # DDP's gradient all-reduce (and its buffer broadcast) ran in the profiled step.
            assert summary.collectives >= 2
            assert 0 < summary.communication_ms < summary.profiled_step_ms
        assert "communication ms (profiled step)" in results["profile"]["summary"]
        assert f"rank {rank} of {WORLD_SIZE}" in results["profile"]["summary"]
        assert results["profile"]["grads_unchanged"]


# ---- refusals, on a one-rank group in this process ---------------------------------------


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fuse_refuses_a_sharded_model(one_rank_group):
    model = models.build_model("llama-tiny")
    fully_shard_function()(model)
    with pytest.raises(RuntimeError, match=r"te_lab\.fuse: parameter 'model\.embed_tokens\.weight' .* is a "
                                           r"DTensor .* fuse the model before sharding it"):
        te_lab.fuse(model)
    assert not te_lab.is_fused(model)


def test_unfuse_refuses_after_sharding(one_rank_group):
    model = models.build_model("llama-tiny")
    te_lab.fuse(model, verify=False)
    fully_shard_function()(model)
    for call, name in ((te_lab.unfuse, "unfuse"), (lambda m: te_lab.unfused(m).__enter__(), "unfused")):
        with pytest.raises(RuntimeError, match=rf"te_lab\.{name}: parameter .* is a DTensor .* stale weights"):
            call(model)
    with pytest.raises(RuntimeError, match=r"te_lab\.profile: parameter .* is a DTensor .* \(baseline, candidate\)"):
        te_lab.profile(model, model.example_batch())
    assert te_lab.is_fused(model)


@pytest.mark.parametrize("entry", ["profile", "profile_statement"])
def test_profile_of_a_ddp_model_backpropagates_through_its_reducer(one_rank_group, entry):
    from torch.nn.parallel import DistributedDataParallel

    from te_lab.profiler import profile_statement

    model = models.build_model("llama-tiny")
    te_lab.fuse(model, verify=False, backend="reference")  # the ops' reference math: nothing to compile
    ddp = DistributedDataParallel(model)
    batch = model.example_batch()
    if entry == "profile":
        report = te_lab.profile(ddp, batch, steps=1, warmup=0)
    else:
        report = profile_statement(lambda: ddp(**batch), {"model": ddp}, steps=1, warmup=0)
    # The keys are the wrapped model's module paths (fuse fused ddp.module).
    assert {"(model) lm_head + loss", "model.layers.0.mlp", "model.norm"} <= {c.key for c in report.modules}
    for mode in ("eager", "fused"):
        # DDP's buffer broadcast in forward and its gradient all-reduce in backward, which
        # torch.autograd.grad would have skipped.
        assert report.modes[mode].collectives == 2
    assert all(p.grad is None for p in ddp.parameters())
    assert report.environment.rank == 0 and report.environment.world_size == 1
    from te_lab.profiler.engine import DATA_PARALLEL_NOTE
    assert report.opportunities is None and DATA_PARALLEL_NOTE in report.notes  # no finder steps under DDP


def test_communication_is_the_union_of_collective_kernels_and_gloo_events():
    kernel = functools.partial(DeviceKernel, blocks=None, occupancy=None, launched_ns=None)
    kernels = [kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 100), kernel("mcclKernel_AllGather", 50, 100),
               kernel("ampere_sgemm_128x64_nn", 120, 500)]  # compute overlapping a collective is not communication
    gloo = [types.SimpleNamespace(name="gloo:all_reduce", time_range=types.SimpleNamespace(start=1.0, end=1.5)),
            types.SimpleNamespace(name="aten::mm", time_range=types.SimpleNamespace(start=0.0, end=9.0))]
    assert communication_ns([], kernels) == (150, 2)
    assert communication_ns(gloo, []) == (500, 1)
    assert communication_ns(gloo, kernels) == (650, 3)


def test_report_files_carry_the_rank(tmp_path):
    report = te_lab.ProfileReport(Environment("cpu", "CPU", torch.__version__, None, 1, "float32"))
    assert report.save(tmp_path / "report.json") == tmp_path / "report.json"
    report.environment.rank, report.environment.world_size = 1, 2
    path = report.save(tmp_path / "report.json")
    assert path == tmp_path / "report.rank1.json"
    assert te_lab.ProfileReport.from_json(path.read_text()).environment == report.environment


def test_report_views_show_communication_apart():
    figures = pytest.importorskip("te_lab.widgets.figures")  # plotly
    environment = Environment("cpu", "CPU", torch.__version__, None, 1, "float32", rank=1, world_size=2)
    report = te_lab.ProfileReport(environment, modes={
        "eager": ModeSummary("eager", [5.0], [2.0], [3.0], 5.0, communication_ms=2.5, collectives=2),
        "fused": ModeSummary("fused", [4.0], [1.5], [2.5], 4.0, communication_ms=1.25, collectives=2)})
    summary = report.summary()
    assert "(cpu, 1 threads, float32, rank 1 of 2)" in summary
    assert re.search(r"communication ms \(profiled step\) +2\.500 +1\.250 +collectives 2/2", summary)
    assert figures.summary_cards(report)[-1] == ("communication (profiled step), rank 1",
                                                 "eager 2.500 ms / fused 1.250 ms")
    report.modes["eager"].communication_ms = report.modes["fused"].communication_ms = None
    assert "communication" not in report.summary()
    assert all("communication" not in title for title, _ in figures.summary_cards(report))


def test_init_process_group_names_the_missing_launch_variables(monkeypatch):
    for name in te_lab.distributed.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set; "
                                           "launch the script with torchrun"):
        te_lab.distributed.init_process_group()


if __name__ == "__main__":
    _session(Path(sys.argv[1]))
