"""Matrix products on GGUF blocks (blockquant.py): found exactly, computed right, the same bits for a row alone or in a batch."""

import contextlib
import pytest
import torch

from specserve_runtime import blockquant
from specserve_runtime.layers import BLOCKQUANT_MAX_ROWS, PackedLinear, weight_layouts
from specserve_runtime.verify import SamplingParams, target_tokens

from .conftest import gguf_values

pytestmark = pytest.mark.skipif(not blockquant.enabled(), reason="needs a C compiler and an AVX2 or AVX-512 CPU")

# Every instruction-set path this CPU runs: both on an AVX-512 machine.
ISAS = [isa for isa in (1, 2) if isa <= blockquant.best_isa()]
needs_vnni = pytest.mark.skipif(not blockquant.int8_enabled(), reason="int8 activations need AVX-512 VNNI")
# blockquant.c's sampling; elsewhere torch's path samples (test_engine)
needs_avx512 = pytest.mark.skipif(blockquant.best_isa() < 2, reason="blockquant.c samples on AVX-512 only")


def random_weight(rows: int, columns: int, fmt: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return gguf_values(torch.randn(rows, columns, generator=generator) * 0.1, fmt)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_blocks_are_found_and_decode_to_every_value_bit_for_bit(fmt):
    weight = random_weight(48, 96, fmt)
    blocks = blockquant.exact_blocks(weight)
    assert blocks.format == fmt
    assert torch.equal(blocks.dequantize(), weight)


def test_a_weight_that_is_not_exactly_blocks_is_left_alone():
    weight = random_weight(8, 64, "Q4_1")
    assert blockquant.exact_blocks(torch.randn(8, 64)) is None  # plain float32
    off_by_one_ulp = weight.clone()
    off_by_one_ulp[3, 17] = torch.nextafter(off_by_one_ulp[3, 17], torch.tensor(1.0))
    assert blockquant.exact_blocks(off_by_one_ulp) is None
    assert blockquant.exact_blocks(weight[:, :48].contiguous()) is None  # 48 columns: no whole blocks
    assert blockquant.exact_blocks(weight.half()) is None


def test_a_block_of_equal_values_is_exact():
    weight = random_weight(4, 64, "Q4_1")
    weight[1, :32] = 0.25
    weight[2, 32:] = 0.0
    blocks = blockquant.exact_blocks(weight)
    assert blocks is not None and torch.equal(blocks.dequantize(), weight)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17])  # around both paths' tiles of rows (4 and 8)
def test_the_product_is_x_times_the_weight(fmt, isa, rows):
    weight = random_weight(40, 160, fmt, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1))
    out = blockquant.linear(x, blockquant.exact_blocks(weight), isa=isa)
    exact = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_row_has_the_same_bits_alone_and_among_others(fmt, isa):
    """What keeps verification lossless: a draft block's first row is the one-token step's product, bit for bit."""
    blocks = blockquant.exact_blocks(random_weight(64, 576, fmt))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2))
    together = blockquant.linear(x, blocks, isa=isa)
    for start, stop in ((0, 1), (5, 6), (3, 10), (0, 19), (18, 19)):
        assert torch.equal(blockquant.linear(x[start:stop], blocks, isa=isa), together[start:stop])


def int8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x rounded per block of 32 to int8 (d = max|x| / 127), times the weight, in float64."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = (blocks.abs().amax(-1) / 127).float().double()
    rounded = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0)[..., None]) * scale[..., None]
    return rounded.reshape(x.shape) @ weight.double().T


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])  # around the tile of 8 rows
def test_on_int8_activations_the_product_is_x_rounded_per_block_times_the_weight(fmt, rows):
    weight = random_weight(48, 160, fmt, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1))
    int8 = blockquant.int8_blocks(weight, blockquant.exact_blocks(weight))
    assert int8.format == fmt  # exact blocks are kept as they are, only x is rounded
    torch.testing.assert_close(blockquant.linear(x, int8).double(), int8_reference(x, weight), rtol=1e-5, atol=1e-5)


@needs_vnni
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_on_int8_activations_a_row_has_the_same_bits_alone_and_among_others(fmt):
    weight = random_weight(64, 576, fmt)
    int8 = blockquant.int8_blocks(weight, blockquant.exact_blocks(weight))
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2))
    together = blockquant.linear(x, int8)
    for start, stop in ((0, 1), (5, 6), (3, 10), (0, 19), (18, 19)):
        assert torch.equal(blockquant.linear(x[start:stop], int8), together[start:stop])


@needs_vnni
def test_a_float32_weight_is_rounded_to_q4_1_for_int8_products_and_misfits_are_left_alone():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    int8 = blockquant.int8_blocks(weight, blockquant.exact_blocks(weight))  # none: rounded
    rounded = blockquant.q4_1_blocks(weight).dequantize()
    blocks = weight.reshape(32, 2, 32)
    step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15  # each block's d
    assert int8.format == "Q4_1" and torch.all((rounded - weight).reshape(32, 2, 32).abs() <= 0.5 * step * 1.01)
    for rounding in (blockquant.q4_1_blocks, blockquant.q8_0_blocks):  # a weight that is its blocks is found exact
        exact = rounding(weight)
        assert blockquant.exact_blocks(exact.dequantize()).format == exact.format
    x = torch.randn(5, 64)
    torch.testing.assert_close(blockquant.linear(x, int8).double(), int8_reference(x, rounded), rtol=1e-5, atol=1e-5)
    assert blockquant.int8_blocks(torch.randn(24, 64), None) is None  # outputs: not whole groups of 16
    assert blockquant.int8_blocks(torch.randn(32, 48), None) is None  # inputs: not whole blocks of 32
    assert blockquant.int8_blocks(torch.randn(32, 64).half(), None) is None


@needs_vnni
def test_packed_linear_on_int8_activations_runs_every_row_count_on_them():
    weight = random_weight(32, 64, "Q4_1")
    linear = PackedLinear(weight, int8_activations=True)
    assert PackedLinear(weight).int8_blocks is None  # only asked for: the target's products stay float32
    for rows in (1, BLOCKQUANT_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64)
        assert torch.equal(linear(x), blockquant.linear(x, linear.int8_blocks))
    assert linear(torch.randn(0, 64)).shape == (0, 32)


@needs_vnni
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_drafters_run_their_products_on_int8_and_the_target_does_not(tiny_llama_blocks, method, monkeypatch):
    from specserve_runtime.drafters import DrafterError, ProposerOptions, build_proposer

    def drafter_linears(proposer):
        return [m for m in proposer.drafter.modules() if isinstance(m, PackedLinear)] + [proposer.head.linear]

    options = ProposerOptions("random", 3, mask_token_id=95, seed=1)
    monkeypatch.delenv("SPECSERVE_DRAFTER_INT8", raising=False)
    assert all(m.int8_blocks is not None for m in drafter_linears(build_proposer(method, tiny_llama_blocks, options)))
    assert all(m.int8_blocks is None for m in tiny_llama_blocks.modules() if isinstance(m, PackedLinear))
    monkeypatch.setenv("SPECSERVE_DRAFTER_INT8", "0")
    assert all(m.int8_blocks is None for m in drafter_linears(build_proposer(method, tiny_llama_blocks, options)))
    monkeypatch.setenv("SPECSERVE_DRAFTER_INT8", "yes")
    with pytest.raises(DrafterError, match="SPECSERVE_DRAFTER_INT8 is 1 .* not 'yes'"):
        build_proposer(method, tiny_llama_blocks, options)


def test_leading_axes_are_kept():
    weight = random_weight(24, 64, "Q4_1")
    x = torch.randn(2, 3, 64)
    out = blockquant.linear(x, blockquant.exact_blocks(weight))
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_only_float32_rows_of_the_right_width_reach_the_kernel():
    weight = random_weight(24, 64, "Q4_1")
    blocks = blockquant.exact_blocks(weight)
    for bad in (torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(2, 32)):
        with pytest.raises(ValueError, match="float32 CPU rows of 64 values"):
            blockquant.linear(bad, blocks)


def test_packed_linear_runs_blocks_up_to_its_row_limit_and_onednn_past_it():
    weight = random_weight(32, 64, "Q4_1")
    linear = PackedLinear(weight)
    assert linear.blocks is not None
    for rows in (0, 1, BLOCKQUANT_MAX_ROWS, BLOCKQUANT_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    x = torch.randn(BLOCKQUANT_MAX_ROWS, 64)
    assert torch.equal(linear(x), blockquant.linear(x, linear.blocks))
    assert PackedLinear(torch.randn(32, 64)).blocks is None


def test_a_gguf_valued_model_runs_its_products_on_blocks(tiny_llama_blocks):
    packed = [m for m in tiny_llama_blocks.modules() if isinstance(m, PackedLinear)]
    assert {m.blocks.format for m in packed} == {"Q4_1", "Q8_0"}  # the layers, and the tied LM head
    assert all(m.blocks is not None for m in packed)
    tokens = torch.tensor([5, 17, 42, 8])
    logits = tiny_llama_blocks(tokens, tiny_llama_blocks.new_cache(8)).logits
    with weight_layouts(tiny_llama_blocks):
        plain = tiny_llama_blocks(tokens, tiny_llama_blocks.new_cache(8)).logits
    torch.testing.assert_close(logits, plain, rtol=1e-4, atol=1e-4)


def test_a_failed_build_names_the_compiler_and_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECSERVE_KERNELS", raising=False)
    with pytest.raises(OSError, match="no C compiler 'no-such-cc'"):
        blockquant.build("no-such-cc")
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'internal compiler error: out of luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(OSError, match="could not build blockquant.c, attention.c, decoder.c: internal compiler error: out of luck"):
        blockquant.build(str(broken))
    assert not list((tmp_path / "kernels").iterdir())  # nothing half-written is left to be loaded later


def test_a_build_is_reused_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECSERVE_KERNELS", raising=False)
    built = blockquant.build()
    assert built == tmp_path / "kernels" / blockquant.library_name()
    assert blockquant.build("no-such-cc") == built  # found, not compiled again


@pytest.mark.parametrize("target", ["tiny_llama_blocks", "tiny_llama_int8"])
def test_the_onednn_baseline_decodes_on_float32_layouts_and_restores_the_blocks(request, target, tmp_path,
                                                                                monkeypatch):
    """Neither blockquant's products nor decoder.c's layers (which read the int8 blocks themselves, the LM head's
    too) run in the baseline; both are back afterwards."""
    from specserve_runtime import bench
    from specserve_runtime.bench import baseline_runners, parse_baselines
    from specserve_runtime.loader import LoadedModel
    from specserve_runtime.native import NativeLayers

    from .conftest import ByteTokenizer

    model = LoadedModel(tmp_path, request.getfixturevalue(target), ByteTokenizer(), {2})
    calls = []
    kernel, layers = blockquant.linear, NativeLayers.run
    monkeypatch.setattr(blockquant, "linear", lambda *args, **kwargs: calls.append("linear") or kernel(*args, **kwargs))
    monkeypatch.setattr(NativeLayers, "run", lambda *args, **kwargs: calls.append(
        "layers and head" if kwargs.get("head") is not None else "layers") or layers(*args, **kwargs))
    runners = baseline_runners(model, parse_baselines("onednn"), context=64, threads=torch.get_num_threads(),
                               servers=contextlib.ExitStack())  # the onednn baseline starts no server
    tokens, seconds, first_token = runners["ar-onednn"]([5, 6, 7], 6)
    assert calls == [] and 1 <= len(tokens) <= 6 and 0 < first_token <= seconds
    plain = bench.build_engine(model, "ar").generate(bench.Request([5, 6, 7], 6))
    assert set(calls) == ({"layers and head"} if target == "tiny_llama_int8" else {"linear"})
    if target == "tiny_llama_blocks":  # the same float32 arithmetic: the same output here
        assert plain.token_ids == tokens


def test_the_bench_names_the_weight_layouts_it_ran_on(tiny_llama_blocks, request):
    from specserve_runtime.bench import machine

    drafters = "int8" if blockquant.int8_enabled() else "float32"
    assert machine(tiny_llama_blocks)["weights"] == (
        f"GGUF blocks on the {blockquant.kernel_name()} kernel up to {BLOCKQUANT_MAX_ROWS} rows, oneDNN float32 "
        f"otherwise; drafters on {drafters} products")
    assert blockquant.kernel_name() in ("AVX-512 VNNI", "AVX-512", "AVX2")
    if blockquant.int8_enabled():
        assert machine(request.getfixturevalue("tiny_llama_int8"))["weights"] == (
            "target on int8 products of the GGUF blocks (AVX-512 VNNI) in C layers (decoder.c); drafters on int8 products")


@pytest.mark.parametrize("rows, n", [(1, 5), (3, 16), (2, 63), (4, 64), (3, 65), (8, 8192), (8, 49152), (2, 49157)])
def test_argmax_picks_each_rows_first_largest_value_as_torch_does(rows, n):
    """Greedy verification's argmax (blockquant.c where the CPU has AVX-512, else torch): the same index as
    torch.argmax for every row, also where the largest value occurs many times (the first wins: in the same lane,
    across lanes and running maxima, in the tail past the last whole 64) and where every value is -inf."""
    generator = torch.Generator().manual_seed(n)
    spread = torch.randn(rows, n, generator=generator)
    ties = torch.randint(-3, 3, (rows, n), generator=generator).float()  # each row's maximum, many times over
    tail = torch.zeros(rows, n)
    tail[:, -1] = tail[:, -3] = 1.0  # the largest value only past the vector part (when n is not a multiple of 64)
    for x in (spread, ties, tail):
        assert torch.equal(blockquant.argmax(x), x.argmax(dim=-1))
    assert blockquant.argmax(torch.full((rows, n), -float("inf"))).tolist() == [0] * rows
    strided = spread.T.contiguous().T  # not contiguous: copied first
    assert torch.equal(blockquant.argmax(strided), spread.argmax(dim=-1))
    assert torch.equal(blockquant.argmax(spread.double()), spread.argmax(dim=-1))  # not float32: torch's


@pytest.mark.parametrize("rows, n, k", [(1, 5, 1), (1, 5, 5), (3, 16, 3), (2, 63, 7), (3, 65, 16), (3, 8192, 3),
                                        (2, 8195, 10)])
def test_top_log_probs_are_each_rows_best_log_softmax_entries_first_of_equal_first(rows, n, k):
    """A drafter's guesses (blockquant.c where the CPU has AVX-512, else torch): each row's k largest entries,
    largest first, as torch's log_softmax values (to its float32 rounding), and where values are equal the first
    index first, also when the k-th place is contested within one register and in the tail past the last whole 16;
    -inf entries count. torch's (its stable sort) where blockquant.c does not run ranks them the same way."""
    generator = torch.Generator().manual_seed(n + k)
    spread = torch.randn(rows, n, generator=generator) * 4
    ties = torch.randint(-3, 3, (rows, n), generator=generator).float()  # the best values, many times over
    tail = torch.zeros(rows, n)
    tail[:, -1] = tail[:, -3] = 1.0  # the best only past the vector part (when n is not a multiple of 16)
    for x in (spread, ties, tail):
        values, indices = blockquant.top_log_probs(x, k)
        expected = torch.log_softmax(x, dim=-1)
        assert values.shape == indices.shape == (rows, k) and indices.dtype == torch.int64
        torch.testing.assert_close(values, expected.gather(1, indices), rtol=0, atol=1e-5)
        # The right entries: the k-th best value, and no better value left out; equal values by first index.
        kth = expected.topk(k, dim=-1).values[:, -1:]
        assert (expected.gather(1, indices) >= kth - 1e-6).all() and (values[:, :-1] >= values[:, 1:]).all()
        for row in range(rows):
            ranked = sorted(range(n), key=lambda i: (-float(x[row, i]), i))[:k]  # a stable sort's first k
            assert indices[row].tolist() == ranked
    floor = spread.clone()
    floor[:, 1::2] = -float("inf")  # entries a mask took away: still entries, ranked last, first index first
    values, indices = blockquant.top_log_probs(floor, k)
    for row in range(rows):
        assert indices[row].tolist() == sorted(range(n), key=lambda i: (-float(floor[row, i]), i))[:k]
    assert torch.isfinite(values[:, : (n + 1) // 2]).all() and (values[:, (n + 1) // 2 :] == -float("inf")).all()
    double_values, double_indices = blockquant.top_log_probs(spread.double(), k)  # not float32: torch's, the same
    assert torch.equal(double_indices, blockquant.top_log_probs(spread, k)[1])
    torch.testing.assert_close(double_values.double(), torch.log_softmax(spread.double(), -1).gather(1, double_indices),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", [1, 5, 17, 4096, 49157])
def test_a_sample_inverts_the_softmaxs_cumulative_distribution_as_torch_does(n):
    """The target's choice at T > 0 (blockquant.c where the CPU has AVX-512): for every uniform number the token whose
    interval of softmax(x / T)'s cumulative distribution holds it, the same token as torch's float64 inversion
    except within float32 rounding of an edge between two tokens; a token of logit -inf is never drawn; a row with
    NaN or +inf is left to torch (None)."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=generator) * 3
    x[:, ::7] = -float("inf") if n > 1 else x[:, ::7]
    uniforms = torch.rand(3, 400, dtype=torch.float64, generator=generator)
    temperature = 0.7
    cdf = torch.softmax(x.double() / temperature, dim=-1).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    for column in range(uniforms.shape[1]):
        u = uniforms[:, column].contiguous()
        chosen = target_tokens(x, SamplingParams(temperature), u)  # blockquant.sample's, or torch's without AVX-512
        expected = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp(max=n - 1)
        edge = (cdf - u.unsqueeze(-1)).abs().min(dim=-1).values  # how near u lies to an edge between two tokens
        assert torch.equal(chosen[edge > 1e-5], expected[edge > 1e-5])
        assert torch.isfinite(x.gather(1, chosen.unsqueeze(1))).all()
    in_c = blockquant.sample(x, temperature, uniforms[:, 0].contiguous())
    assert (in_c is not None) == (blockquant.best_isa() >= 2)  # where AVX-512 runs, the kernel's choice is the one above
    broken = x.clone()
    broken[1, 0] = float("nan")
    assert blockquant.sample(broken, temperature, uniforms[:, 0]) is None
    broken[1, 0] = float("inf")
    assert blockquant.sample(broken, temperature, uniforms[:, 0]) is None
    assert blockquant.sample(x.double(), temperature, uniforms[:, 0]) is None  # not float32: torch's


@needs_avx512
@pytest.mark.parametrize("n", [1, 5, 17, 4096, 49157])
@pytest.mark.parametrize("scale, fraction", [(3.0, 0.9), (3.0, 0.3), (0.3, 0.99), (20.0, 0.5)])
def test_a_nucleus_sample_draws_from_the_most_likely_tokens_reaching_top_p_as_torch_does(n, scale, fraction):
    """With top_p < 1, blockquant.c draws from the nucleus only: the most likely tokens whose mass before them is
    below top_p (the most likely always), by inverting their cumulative distribution in index order: for every
    uniform number the token torch's float64 definition (a stable sort of the whole row) gives, except within 1e-6
    of an edge between two tokens; from broad distributions (nuclei of tens of thousands of
    tokens) to peaked ones. Each row's top_p lies halfway between two tokens' cumulative mass, so float rounding
    cannot move the nucleus's edge."""
    generator = torch.Generator().manual_seed(n + int(scale * 10))
    x = torch.randn(3, n, generator=generator) * scale
    x[:, 3::7] = -float("inf")
    uniforms = torch.rand(400, dtype=torch.float64, generator=generator)
    temperature = 0.7
    for row in x:
        probs = torch.softmax(row.double() / temperature, dim=-1)
        ordered, order = probs.sort(descending=True, stable=True)
        before = ordered.cumsum(dim=-1) - ordered
        last = max(int((before < fraction).sum()) - 1, 0)  # the last token inside at top_p = fraction
        top_p = float(before[last] + ordered[last] / 2) if last + 1 < n else 1.0 - 1e-12
        inside = torch.zeros(n, dtype=torch.bool)
        inside[order[: last + 1]] = True
        cdf = torch.where(inside, probs, 0.0).cumsum(dim=-1)
        cdf = cdf / cdf[-1]
        edge = (cdf.unsqueeze(0) - uniforms.unsqueeze(1)).abs().min(dim=-1).values
        expected = torch.searchsorted(cdf, uniforms, right=True).clamp(max=n - 1)
        chosen = torch.cat([blockquant.sample(row.unsqueeze(0), temperature, u.reshape(1), top_p) for u in uniforms])
        assert inside[chosen].all()  # never a token outside the nucleus, never one of logit -inf
        away = edge > 1e-6  # C's cumulative sums of float32 weights are within about 1e-7 of torch's float64 ones
        assert torch.equal(chosen[away], expected[away])
        assert away.sum() > 300


@needs_avx512
def test_a_nucleus_of_equal_tokens_takes_the_first_and_the_target_choice_samples_through_it():
    """Equal weights are taken lowest index first: 8 equal logits at top_p 0.3 keep tokens 0, 1 and 2 (the mass
    before each below 0.3), each drawn with a third of the uniform numbers; verify.target_tokens samples through it."""
    x = torch.zeros(1, 8)
    for u, token in ((0.0, 0), (0.32, 0), (0.34, 1), (0.66, 1), (0.67, 2), (0.999, 2)):
        uniform = torch.tensor([u], dtype=torch.float64)
        assert blockquant.sample(x, 1.0, uniform, 0.3).item() == token
        assert target_tokens(x, SamplingParams(1.0, top_p=0.3), uniform).item() == token
    assert blockquant.sample(x, 1.0, torch.tensor([0.5], dtype=torch.float64), 1.5) is None  # top_p out of range
