"""Memory model: ZeRO states, Korthikanti activation formulas, in-flight micro-batches."""

import pytest

from ndtrain.model.config import preset
from ndtrain.layout import Layout
from ndtrain.planner.stack import STACKS
from ndtrain.planner.memory import activation_bytes, in_flight, memory_breakdown, state_bytes
from ndtrain.planner.problem import Split, make_problem, stage_split
from ndtrain.planner.published import ZERO_EXAMPLE
from ndtrain.planner.shapes import gpt_shape, shape_of

MEG = STACKS["megatron-2021"]
NDT = STACKS["ndtrain"]


def test_zero_paper_example_exactly():
    psi, nd = ZERO_EXAMPLE["params"], ZERO_EXAMPLE["dp"]
    for stage, gb in ZERO_EXAMPLE["gb"].items():
        total = sum(state_bytes(psi, stage, nd, pbytes=2)) / 1e9
        assert round(total, 1) == gb, (stage, total)
    # the unrounded values of the paper's arithmetic
    assert sum(state_bytes(psi, 1, nd, 2)) == pytest.approx(4 * psi + 12 * psi / nd)
    assert sum(state_bytes(psi, 2, nd, 2)) == pytest.approx(2 * psi + 14 * psi / nd)
    assert sum(state_bytes(psi, 3, nd, 2)) == pytest.approx(16 * psi / nd)


# GPT shape with a=32 heads, h=4096, s=2048, b=4: Korthikanti et al. 2022, Table 2.
S, B, H, A, T = 2048, 4, 4096, 32, 8
GPT = shape_of(gpt_shape(H, 4, A))
SBH = S * B * H


def test_korthikanti_no_recompute():
    assert activation_bytes(GPT, MEG, S, B) == pytest.approx(SBH * (34 + 5 * A * S / H))


def test_korthikanti_tensor_parallel():
    assert activation_bytes(GPT, MEG, S, B, t=T) == pytest.approx(SBH * (10 + 24 / T + 5 * A * S / (H * T)))


def test_korthikanti_tensor_and_sequence_parallel():
    assert activation_bytes(GPT, MEG, S, B, t=T, sp=True) == pytest.approx(SBH / T * (34 + 5 * A * S / H))


def test_korthikanti_selective_recompute_with_sp():
    assert activation_bytes(GPT, MEG, S, B, t=T, sp=True, ac="selective") == pytest.approx(34 * SBH / T)


def test_korthikanti_full_recompute():
    assert activation_bytes(GPT, MEG, S, B, t=T, ac="full") == pytest.approx(2 * SBH)
    assert activation_bytes(GPT, MEG, S, B, t=T, sp=True, ac="full") == pytest.approx(2 * SBH / T)


def test_context_parallel_divides_sequence_activations():
    whole = activation_bytes(GPT, NDT, S, B, t=T, sp=True)
    assert activation_bytes(GPT, NDT, S, B, t=T, sp=True, cp=4) == pytest.approx(whole / 4)


def test_swiglu_gqa_adaptation_llama3_8b():
    sh = shape_of(preset("llama3-8b"))  # h 4096, 32 heads, 8 kv heads, ffn 14336 = 3.5h
    s, b = 8192, 1
    sbh = s * b * 4096
    lse = 4 * 32 * s * b  # fp32 log-sum-exp the flash kernel keeps per row and head
    # R = 8 (two norm inputs and outputs, no dropout); S = Q 2 + K,V 4*(8/32) + out 2 + SwiGLU 8*3.5
    assert activation_bytes(sh, NDT, s, b) == pytest.approx(sbh * (8 + 2 + 1 + 2 + 28) + lse)
    assert activation_bytes(sh, NDT, s, b, t=4, sp=True) == pytest.approx(sbh * 41 / 4 + lse / 4)
    # selective recomputes silu(gate) and the product: SwiGLU keeps 4*3.5 instead of 8*3.5
    assert activation_bytes(sh, NDT, s, b, ac="selective") == pytest.approx(sbh * 27 + lse)
    assert activation_bytes(sh, NDT, s, b, ac="full") == pytest.approx(2 * sbh)


def test_in_flight_per_schedule():
    p, v, m = 8, 4, 64
    assert in_flight("1F1B", p, 1, m) == (8, 1)
    assert in_flight("GPipe", p, 1, m) == (64, 64)
    first, _ = in_flight("Interleaved1F1B", p, v, m)
    assert first == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert in_flight("ZBVZeroBubble", p, 2, m) == (8, 8)
    assert in_flight("DualPipeV", p, 2, m)[0] == pytest.approx(8.5)
    assert in_flight("1F1B", 1, 1, m) == (1, 1)


def test_the_planner_costs_the_runtimes_stage_split():
    # One partition (ndtrain.layout.partition): the balanced split gives the first and last stage
    # of Llama 3 405B (embedding, head) a layer fewer, as Meta did; per rank under interleaving.
    pb = make_problem(preset("llama3-405b"), 8192, 2048, 16384, "h100")
    split = stage_split(pb, Layout(dp_shard=128, tp=8, pp=16, pp_schedule="1F1B"))
    assert split.counts == (7,) + (8,) * 14 + (7,) and split.ranks == split.counts and split.head_rank == 15
    v2 = stage_split(pb, Layout(dp_shard=128, tp=8, pp=16, pp_virtual_stages=2, pp_schedule="Interleaved1F1B"))
    assert sum(v2.counts) == 126 and len(v2.counts) == 32 and sum(v2.ranks) == 126 and v2.head_rank == 15
    zbv = stage_split(pb, Layout(dp_shard=128, tp=8, pp=16, pp_virtual_stages=2, pp_schedule="ZBVZeroBubble"))
    assert zbv.head_rank == 0  # the V puts the first and last stage on rank 0
    assert stage_split(pb, Layout(dp_shard=8, tp=8, pp=128, pp_virtual_stages=2, pp_schedule="Interleaved1F1B")) is None


def test_breakdown_adds_up_and_names_the_device():
    pb = make_problem(preset("llama3-8b"), 4096, 64, 8, "h100")
    lay = Layout(dp_shard=2, tp=2, pp=2, zero=1, micro_batch=1, activation_checkpoint="selective", pp_schedule="1F1B")
    mem = memory_breakdown(pb, lay, Split((16, 16), 1, (16, 16)))
    parts = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "fragmentation")
    assert mem["total"] == pytest.approx(sum(mem[k] for k in parts))
    assert mem["device"] in ("first", "last")
    assert mem["fragmentation"] == pytest.approx(0.1 * (mem["activations"] + mem["logits"] + mem["buffers"]))
