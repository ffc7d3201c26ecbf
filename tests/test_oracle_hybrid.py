"""End-to-end oracle for hybrid models: recurrent state (Mamba2, gated delta net, short conv)
moved with attention K/V between engines of different TP sizes and kernel ratios.

Each case prefills a tiny random transformers model, exports its cache (attention K/V and
conv / SSM state) into the prefill engine's paged ranks, plans and executes the move to a decode
engine of another shape, rebuilds the transformers cache and continues greedy decoding: the
tokens must equal plain `generate` and the rebuilt cache must be bit-identical. The two sides
always differ in kernel blocks per logical block, as vLLM's hybrid engines do (R depends on TP).

Further tests check the component mapping against the models' own tensors (independently of the
export/import round trip), prove the oracle fails on a flipped state byte, and that decoding
really consumes the moved state.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.proofs.cache_compare import cache_differences
from kvbridge.proofs.hf_cache import export_cache, import_cache, replica_mismatches
from kvbridge.proofs.hf_states import hf_state_shapes
from kvbridge.proofs.local_demo import run_demo, vllm_block_size
from kvbridge.proofs.proof import greedy_config, make_prompt_ids
from kvbridge.proofs.tiny_models import BUILTIN_MODELS, HYBRID_MODELS, load_model, spec_for
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.local import LocalExecutor
from kvbridge.proofs.verify import random_bytes, random_request
from kvbridge.models import spec_from_hf_config

pytestmark = pytest.mark.oracle

MAX_PROMPT = 64


def L(tp: int = 1, block: int = 16, kernel: int | None = None, **kw) -> EngineLayout:  # noqa: N802
    """A layout with room for twice the longest prompt, so block ids (and state slots) scatter."""
    return EngineLayout(tp_size=tp, block_size=block, kernel_block_size=kernel,
                        num_blocks=2 * math.ceil(MAX_PROMPT / block) + 1, **kw)


# Kernel blocks per logical block differ on the two sides in every shape (R_P vs R_D).
SHAPES = [
    lambda p, d: (L(p, 32, 16), L(d, 48, 16)),                                      # R 2 vs 3
    lambda p, d: (L(p, 64, 16, kv_order="NHD"), L(d, 16)),                          # R 4 vs 1
    lambda p, d: (L(p, 16), L(d, 32, 8, kv_placement="blocks_first")),              # R 1 vs 4
    lambda p, d: (L(p, 48, 16, kv_placement="blocks_first"), L(d, 32, 16, kv_order="NHD")),  # R 3 vs 2
]
DIVISIBLE = [(1, 2), (2, 1), (4, 1), (1, 4)]
NON_DIVISIBLE = {"tiny-granite-hybrid": [(3, 2), (2, 3)], "tiny-lfm2": [(3, 2), (2, 3)]}


def _cases() -> dict[str, tuple[str, int, EngineLayout, EngineLayout]]:
    cases = {}
    for mi, model in enumerate(HYBRID_MODELS):
        for i, (p, d) in enumerate(DIVISIBLE + NON_DIVISIBLE.get(model, [])):
            prefill, decode = SHAPES[(i + mi) % len(SHAPES)](p, d)
            assert prefill.kernel_blocks_per_block != decode.kernel_blocks_per_block
            cases[f"{model}-P{p}-D{d}-R{prefill.kernel_blocks_per_block}v{decode.kernel_blocks_per_block}"] = (
                model, 21 + 3 * i + mi, prefill, decode)
    return cases


CASES = _cases()


def test_every_hybrid_model_covers_the_pairs() -> None:
    assert set(HYBRID_MODELS) <= set(BUILTIN_MODELS)
    for model in HYBRID_MODELS:
        spec = spec_for(BUILTIN_MODELS[model]())
        assert spec.has_recurrent and any(not x.is_recurrent for x in spec.layers)
        for tp in (1, 2, 4):
            EngineLayout(tp_size=tp).check_model(spec)  # legal
    kinds = {m: spec_for(BUILTIN_MODELS[m]()).layers[0].recurrent_type for m in HYBRID_MODELS}
    assert kinds == {"tiny-bamba": "mamba2", "tiny-granite-hybrid": "mamba2", "tiny-qwen3-next": "gdn",
                     "tiny-lfm2": "short_conv"}
    for model in NON_DIVISIBLE:
        EngineLayout(tp_size=3).check_model(spec_for(BUILTIN_MODELS[model]()))


@pytest.mark.parametrize("case", list(CASES))
def test_disaggregated_hybrid_decode_matches_generate(case: str) -> None:
    model, prompt_len, prefill, decode = CASES[case]
    r = run_demo(model, prompt_len, new_tokens=4, seed=len(case), prefill=prefill, decode=decode)
    assert r.cache_equal, r.cache_differences
    assert r.replicas_equal, r.cache_differences
    assert r.match, (r.tokens_reference, r.tokens_disaggregated)
    assert len(set(r.tokens_reference)) > 1  # a model that repeats one token would prove little


def test_vllm_like_kernel_ratios_depend_on_tp() -> None:
    """Like vLLM's hybrid engines, R = ceil(state / attention kernel page) per rank: bamba's 4 KV heads
    replicate at TP 8 while its state keeps shrinking, so R drops there."""
    spec = spec_for(BUILTIN_MODELS["tiny-bamba"]())
    assert [vllm_block_size(spec, tp, 16) for tp in (1, 2, 4, 8)] == [32, 32, 32, 16]
    assert [vllm_block_size(spec, tp, 4) for tp in (1, 4, 8)] == [28, 28, 16]
    assert vllm_block_size(spec_for(BUILTIN_MODELS["tiny-llama"]()), 2, 16) == 16
    for (p, kp), (d, kd) in (((1, 16), (8, 16)), ((4, 4), (8, 4))):
        prefill = L(p, vllm_block_size(spec, p, kp), kp)
        decode = L(d, vllm_block_size(spec, d, kd), kd)
        r = run_demo("tiny-bamba", 45, 3, p, prefill, decode)
        assert r.ok, r.cache_differences


def _expected_bytes(spec: ModelSpec, decode: EngineLayout, n: int, cached: int) -> int:
    """Bytes every decode rank must receive: its shard of positions [cached, n) and of the state."""
    total = 0
    for rank in range(decode.tp_size):
        a = decode.addressing(spec, rank)
        for li, layer in enumerate(spec.layers):
            per = sum(int(a.heads[li, ci] * a.row_bytes[li, ci]) for ci in range(len(layer.components)))
            total += per if layer.is_recurrent else per * (n - max(cached, layer.tokens_kept(n)))
    return total


@pytest.mark.parametrize("model", HYBRID_MODELS)
def test_prefix_hit_moves_only_the_rest(model: str) -> None:
    """The decode engine already holds 48 tokens (one logical block of 48, three kernel blocks of 16);
    the prefill side has logical blocks of 32 (two kernel blocks): only positions 48.. and the state move."""
    n, cached = 61, 48
    prefill, decode = L(2, 32, 16), L(1, 48, 16)
    r = run_demo(model, n, new_tokens=3, seed=7, prefill=prefill, decode=decode, num_cached_tokens=cached)
    assert r.ok, (r.cache_differences, r.tokens_reference, r.tokens_disaggregated)
    assert r.num_cached_tokens == cached and "48 cached on decode" in r.summary()
    spec = spec_for(BUILTIN_MODELS[model]())
    assert r.bytes_moved == _expected_bytes(spec, decode, n, cached)
    assert r.bytes_moved < _expected_bytes(spec, decode, n, 0)


def test_prefix_hit_across_tp_and_kernel_ratios() -> None:
    r = run_demo("tiny-qwen3-next", 57, 3, 3, L(1, 16), L(4, 32, 8, kv_order="NHD"), num_cached_tokens=32)
    assert r.ok, r.cache_differences
    spec = spec_for(BUILTIN_MODELS["tiny-qwen3-next"]())
    assert r.bytes_moved == _expected_bytes(spec, L(4, 32, 8), 57, 32)


def test_prefix_hit_may_end_inside_a_decode_block() -> None:
    """The planner's rule (the one `kvbridge plan` applies too): any count below the prompt length."""
    r = run_demo("tiny-bamba", 50, 2, prefill=L(1), decode=L(1, 48, 16), num_cached_tokens=32)
    assert r.ok, r.cache_differences
    with pytest.raises(InvalidRequest, match=r"in \[0, 40\)"):
        run_demo("tiny-bamba", 40, 2, prefill=L(1), decode=L(1, 16), num_cached_tokens=48)


@pytest.mark.parametrize("model", ["tiny-bamba", "tiny-lfm2"])
def test_prompt_shorter_than_the_conv_kernel(model: str) -> None:
    """transformers left-pads the conv state with zeros; those zeros move like any state."""
    r = run_demo(model, 2, 3, 1, L(1, 16), L(2, 32, 16))
    assert r.ok, r.cache_differences


@pytest.mark.parametrize("model", HYBRID_MODELS)
def test_dump_holds_conv_and_recurrent_states_as_transformers_does(tmp_path, model: str) -> None:
    path = tmp_path / "decode_cache.safetensors"
    n, seed = 29, 4
    r = run_demo(model, n, 2, seed, L(4, 32, 16), L(1, 48, 16), dump_decode_cache=path)
    assert r.ok
    dumped = load_file(str(path))
    m, config = load_model(model, seed)
    spec = spec_for(config)
    with torch.inference_mode():
        ref = m(torch.tensor([make_prompt_ids(n, config.vocab_size, seed)]), use_cache=True).past_key_values
    want = set()
    for i, layer in enumerate(spec.layers):
        if not layer.is_recurrent:
            want |= {f"layers.{i}.keys", f"layers.{i}.values"}
            continue
        conv_shapes, rec_shape = hf_state_shapes(layer)
        assert len(conv_shapes) == 1
        names = {"conv_states.0": conv_shapes[0]} | ({"recurrent_states.0": rec_shape} if rec_shape else {})
        for name, shape in names.items():
            t = dumped[f"layers.{i}.{name}"]
            held = getattr(ref.layers[i], name.split(".")[0])[0]
            assert t.shape == shape == held.shape and t.dtype == torch.float32
            assert torch.equal(t.view(torch.int32), held.contiguous().view(torch.int32))
            want.add(f"layers.{i}.{name}")
    assert set(dumped) == want
    rec = next(x for x in spec.layers if x.is_recurrent)
    conv_dim = {"tiny-bamba": 128 + 2 * 2 * 8, "tiny-granite-hybrid": 96 + 2 * 8, "tiny-qwen3-next": 2 * 16 + 32,
                "tiny-lfm2": 48}[model]
    kernel = {"tiny-lfm2": 3}.get(model, 4)
    assert hf_state_shapes(rec)[0] == ((1, conv_dim, kernel),)


# --- the component mapping matches the models' own tensors ---------------------------------


def _prefill_ranks(model_name: str, n: int, layout: EngineLayout, seed: int = 0):
    """Prefill, export into `layout`'s ranks; also return each layer-0 mixer's projections."""
    model, config = load_model(model_name, seed)
    spec = spec_for(config)
    captured: dict[str, torch.Tensor] = {}
    layer0 = model.model.layers[0]
    mixer = next(getattr(layer0, name) for name in ("mamba", "linear_attn", "conv") if hasattr(layer0, name))
    for name in ("in_proj", "in_proj_qkvz", "in_proj_ba"):
        if hasattr(mixer, name):
            getattr(mixer, name).register_forward_hook(lambda _m, _i, out, name=name: captured.__setitem__(name, out))
    with torch.inference_mode():
        ref = model(torch.tensor([make_prompt_ids(n, config.vocab_size, seed)]), use_cache=True).past_key_values
    ranks = RankCache.allocate_engine(spec, layout)
    request = random_request(spec, layout, layout, n, 0, random.Random(seed))
    export_cache(ref, spec, ranks, request.src_block_ids, n)
    slot = request.src_block_ids[spec.layer_group[0]][-1]
    return spec, mixer, captured, ranks, slot, ref


def _units(ranks: list[RankCache], spec: ModelSpec, comp: int, slot: int) -> dict[int, torch.Tensor]:
    """Unit -> [dim] as each rank holds it in its slot (all replicas must agree)."""
    out: dict[int, torch.Tensor] = {}
    for rc in ranks:
        u0 = int(rc.addr.first_head[0, comp])
        for j, row in enumerate(rc.read_state(0, comp, slot)):
            assert out.setdefault(u0 + j, row).equal(row)
    assert sorted(out) == list(range(spec.layers[0].state[comp].heads))
    return out


def test_mamba2_components_are_x_heads_and_b_c_groups() -> None:
    """tiny-bamba at TP 4: 2 heads per rank, the 2 groups replicated over rank pairs. Unit g of conv_b
    holds group g's d_state channels of B, each with the last `kernel` inputs of the causal conv."""
    n = 19
    spec, mixer, cap, ranks, slot, ref = _prefill_ranks("tiny-bamba", n, L(4))
    rows, inter, G, N, H, P = 4, mixer.intermediate_size, mixer.n_groups, mixer.ssm_state_size, mixer.num_heads, \
        mixer.head_dim
    xbc = cap["in_proj"][0, -rows:, inter:inter + mixer.conv_dim]  # [rows, conv_dim]: the conv's last inputs
    x = xbc[:, :inter].reshape(rows, H, P)
    B = xbc[:, inter:inter + G * N].reshape(rows, G, N)
    C = xbc[:, inter + G * N:].reshape(rows, G, N)
    names = [c.name for c in spec.layers[0].state]
    assert names == ["conv_x", "conv_b", "conv_c", "ssm"]
    for h, row in _units(ranks, spec, 0, slot).items():
        assert torch.equal(row.reshape(P, rows), x[:, h, :].T)
    for comp, t in ((1, B), (2, C)):
        for g, row in _units(ranks, spec, comp, slot).items():
            assert torch.equal(row.reshape(N, rows), t[:, g, :].T)
    assert [int(rc.addr.first_head[0, 1]) for rc in ranks] == [0, 0, 1, 1]  # groups replicate at TP 4
    ssm = ref.layers[0].recurrent_states[0][0]  # [heads, head_dim, d_state]
    for h, row in _units(ranks, spec, 3, slot).items():
        assert torch.equal(row.reshape(P, N), ssm[h])


def test_gdn_components_are_q_k_v_heads() -> None:
    """tiny-qwen3-next at TP 4: the 2 key heads (conv_q, conv_k) replicate, the 4 value heads shard;
    the recurrent state is [v_heads, k_head_dim, v_head_dim]."""
    n = 23
    spec, mixer, cap, ranks, slot, ref = _prefill_ranks("tiny-qwen3-next", n, L(4))
    rows = mixer.conv_kernel_size
    q, k, v, *_ = mixer.fix_query_key_value_ordering(cap["in_proj_qkvz"], cap["in_proj_ba"])
    assert [c.name for c in spec.layers[0].state] == ["conv_q", "conv_k", "conv_v", "recurrent"]
    for comp, t in ((0, q), (1, k), (2, v)):
        last = t[0, -rows:]  # [rows, heads, head_dim]
        for h, row in _units(ranks, spec, comp, slot).items():
            assert torch.equal(row.reshape(last.shape[2], rows), last[:, h, :].T), (comp, h)
    assert [int(rc.addr.first_head[0, 0]) for rc in ranks] == [0, 0, 1, 1]
    assert [int(rc.addr.first_head[0, 2]) for rc in ranks] == [0, 1, 2, 3]
    state = ref.layers[0].recurrent_states[0][0]
    assert state.shape == (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    for h, row in _units(ranks, spec, 3, slot).items():
        assert torch.equal(row.reshape(state.shape[1:]), state[h])


def test_short_conv_units_are_channels() -> None:
    n = 17
    spec, mixer, cap, ranks, slot, ref = _prefill_ranks("tiny-lfm2", n, L(3))
    rows = mixer.conv_kernel_size
    bcx = cap["in_proj"].transpose(-1, -2)
    b, _, x = bcx.chunk(3, dim=-2)
    bx = (b * x)[0, :, -rows:]  # [hidden, rows]
    units = _units(ranks, spec, 0, slot)
    assert torch.equal(torch.stack([units[c] for c in range(len(units))]), bx)
    assert ref.layers[0].recurrent_states[0] is None


# --- errors name both sides ----------------------------------------------------------------


def _prefill(model_name: str, n: int, seed: int = 0):
    model, config = load_model(model_name, seed)
    with torch.inference_mode():
        cache = model(torch.tensor([make_prompt_ids(n, config.vocab_size, seed)]), use_cache=True).past_key_values
    return config, cache


def test_engine_view_conv_rows_are_refused_naming_both_shapes() -> None:
    config, cache = _prefill("tiny-bamba", 12)
    engine = spec_from_hf_config(config.to_dict(), view="engine", dtype="float32")
    layout = L(1)
    ids = random_request(engine, layout, layout, 12, 0, random.Random(0)).src_block_ids
    with pytest.raises(ConfigError, match=r"caches conv state \(1, 160, 4\), kvbridge's spec says \(1, 160, 3\)"):
        export_cache(cache, engine, RankCache.allocate_engine(engine, layout), ids, 12)


def test_state_dtype_mismatch_is_refused_naming_both() -> None:
    config, cache = _prefill("tiny-qwen3-next", 12)
    wrong = spec_for(config, state_dtype="bfloat16")
    layout = L(1)
    ids = random_request(wrong, layout, layout, 12, 0, random.Random(0)).src_block_ids
    with pytest.raises(ConfigError, match="keeps 'recurrent' as torch.float32, kvbridge's spec says bfloat16"):
        export_cache(cache, wrong, RankCache.allocate_engine(wrong, layout), ids, 12)


def test_wrong_state_geometry_is_refused() -> None:
    config, cache = _prefill("tiny-lfm2", 12)
    spec = spec_for(config)
    rec = spec.layers[0]
    wrong_rec = msgspec.structs.replace(rec, state=(msgspec.structs.replace(rec.state[0], heads=24),))
    wrong = msgspec.structs.replace(spec, layers=(wrong_rec, spec.layers[1], wrong_rec))
    layout = L(1)
    ids = random_request(wrong, layout, layout, 12, 0, random.Random(0)).src_block_ids
    with pytest.raises(ConfigError, match=r"conv state \(1, 48, 3\), kvbridge's spec says \(1, 24, 3\)"):
        export_cache(cache, wrong, RankCache.allocate_engine(wrong, layout), ids, 12)


def test_a_model_without_attention_layers_is_refused_up_front(tmp_path) -> None:
    """Granite-hybrid with every layer linear attention: transformers' own generate cannot continue
    its cache (Cache.get_seq_length needs an attention layer), so the proof refuses it at once;
    Mamba and Mamba2, which generate without attention, move (tests/models/test_recurrent_only.py)."""
    model, config = load_model("tiny-granite-hybrid", 0)
    config.layer_types = ["linear_attention"] * 3
    type(model)(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="every layer is recurrent"):
        run_demo(str(tmp_path), 8, 2)


def test_import_refuses_a_config_of_another_model() -> None:
    spec = spec_for(BUILTIN_MODELS["tiny-bamba"]())
    ranks = RankCache.allocate_engine(spec, L(1))
    ids = random_request(spec, L(1), L(1), 8, 0, random.Random(0)).dst_block_ids
    with pytest.raises(ConfigError, match="config makes a cache of 2 layers, the rank caches have 3"):
        import_cache(ranks, ids, 8, BUILTIN_MODELS["tiny-llama"]())
    with pytest.raises(ConfigError, match="layer 0: the spec says recurrent"):  # same layer count, no state
        import_cache(ranks, ids, 8, BUILTIN_MODELS["tiny-qwen2"]())


# --- the oracle can fail -------------------------------------------------------------------


def _pipeline(name: str, n: int, prefill: EngineLayout, decode: EngineLayout, seed: int = 0):
    model, config = load_model(name, seed)
    spec = spec_for(config)
    ids = torch.tensor([make_prompt_ids(n, config.vocab_size, seed)])
    with torch.inference_mode():
        ref = model(ids, use_cache=True).past_key_values
    src = RankCache.allocate_engine(spec, prefill, fill=None)
    dst = RankCache.allocate_engine(spec, decode, fill=None)
    random_bytes(src, seed + 1)
    random_bytes(dst, seed + 2)
    request = random_request(spec, prefill, decode, n, 0, random.Random(seed))
    export_cache(ref, spec, src, request.src_block_ids, n)
    LocalExecutor(src, dst).execute(plan_request(spec, prefill, decode, request))
    return model, config, spec, ids, ref, dst, request


def _flip_state(cache: RankCache, layer: int, comp: int, slot: int, unit: int, element: int) -> None:
    """Flip the sign bit of one state element, located through the rank's byte addressing."""
    a = cache.addr
    isz = cache.spec.component_itemsize(cache.spec.layers[layer].state[comp])
    byte = int(a.base[layer, comp] + slot * a.block_stride[layer, comp]
               + (unit - a.first_head[layer, comp]) * a.head_stride[layer, comp]) + element * isz
    cache.byte_regions()[int(a.region[layer, comp])][byte + isz - 1] ^= 0x80


def test_clean_hybrid_pipeline_reimports_bit_exact() -> None:
    n = 26
    _, config, spec, _, ref, dst, request = _pipeline("tiny-bamba", n, L(2, 32, 16), L(4, 48, 16))
    assert cache_differences(ref, import_cache(dst, request.dst_block_ids, n, config)) == []
    assert replica_mismatches(dst, request.dst_block_ids, n) == []


def test_corrupted_conv_state_is_detected_at_its_channel() -> None:
    """Decode TP 4 holds bamba's 2 B groups on ranks (0,1) and (2,3); rank 2 is group 1's first holder."""
    n = 26
    _, config, spec, _, ref, dst, request = _pipeline("tiny-bamba", n, L(2, 32, 16), L(4, 48, 16))
    slot = request.dst_block_ids[spec.layer_group[2]][-1]
    rows, d_state, inter = 4, 8, 128
    element = 13  # d_state index 3, row 1
    _flip_state(dst[2], 2, 1, slot, unit=1, element=element)
    imported = import_cache(dst, request.dst_block_ids, n, config)
    assert cache_differences(ref, imported) == ["layer 2 conv_states.0: 1 of 640 elements differ"]
    channel = inter + 1 * d_state + element // rows
    got = imported.layers[2].conv_states[0][0, channel, element % rows]
    assert torch.equal(got, -ref.layers[2].conv_states[0][0, channel, element % rows])


def test_corrupted_ssm_state_is_detected_at_its_head() -> None:
    n = 30
    _, config, spec, _, ref, dst, request = _pipeline("tiny-qwen3-next", n, L(1, 16), L(2, 32, 8))
    slot = request.dst_block_ids[spec.layer_group[0]][-1]
    _flip_state(dst[1], 0, 3, slot, unit=3, element=8 * 2 + 5)  # v head 3 lives on decode rank 1; [k=2, v=5]
    imported = import_cache(dst, request.dst_block_ids, n, config)
    assert cache_differences(ref, imported) == ["layer 0 recurrent_states.0: 1 of 256 elements differ"]
    assert torch.equal(imported.layers[0].recurrent_states[0][0, 3, 2, 5],
                       -ref.layers[0].recurrent_states[0][0, 3, 2, 5])


def test_corrupted_state_replica_is_detected() -> None:
    """import takes each unit from its first holder; a bad second replica is caught separately."""
    n = 26
    _, config, spec, _, ref, dst, request = _pipeline("tiny-bamba", n, L(2, 32, 16), L(4, 48, 16))
    slot = request.dst_block_ids[spec.layer_group[0]][-1]
    _flip_state(dst[3], 0, 2, slot, unit=1, element=0)
    assert cache_differences(ref, import_cache(dst, request.dst_block_ids, n, config)) == []
    assert replica_mismatches(dst, request.dst_block_ids, n) == ["layer 0 conv_c unit 1: rank 3 differs from rank 2"]


@pytest.mark.parametrize("model", ["tiny-bamba", "tiny-lfm2"])
def test_decoding_consumes_the_moved_state(model: str) -> None:
    """Zeroing the moved state (keeping attention intact) changes the generated tokens: the oracle's
    token check sees the state, not only the attention cache."""
    n, new = 30, 6
    m, config, spec, ids, ref, dst, request = _pipeline(model, n, L(1), L(2))
    m.generation_config = greedy_config()
    with torch.inference_mode():
        want = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new)[0, n:].tolist()

        def decode() -> list[int]:
            imported = import_cache(dst, request.dst_block_ids, n, config)
            cont = torch.cat([ids, torch.tensor([[want[0]]])], dim=1)
            return [want[0]] + m.generate(cont, attention_mask=torch.ones_like(cont), past_key_values=imported,
                                          max_new_tokens=new - 1)[0, n + 1:].tolist()

        assert decode() == want
        for rc in dst:
            for li, layer in enumerate(spec.layers):
                if layer.is_recurrent:
                    for ci in range(len(layer.state)):
                        rc.logical_view(li, ci)[request.dst_block_ids[spec.layer_group[li]][-1]] = 0
        assert decode() != want
