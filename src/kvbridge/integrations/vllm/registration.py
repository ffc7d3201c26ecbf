"""What vLLM hands a worker (`register_kv_caches`), described as a kvbridge spec and layout and
checked against it, so that a vLLM whose cache differs is refused instead of misread.

`spec_and_layout`: one KV-cache group of K/V attention layers (vLLM CPU's `[blocks, heads,
block, 2 * head_dim]` per layer, checked by shape and against vLLM's own CPU cache-write kernel,
`check_cpu_kv_layout`); several groups or Mamba-style state (vLLM's hybrid allocator): the
geometry from the model's config through transformers, the conv state in vLLM's row order, one
unified padded page per block id, every registered tensor's shape and block stride checked; MLA
(vLLM CPU's `[blocks, block, latent]` per layer): the geometry from the config, each tensor's shape
checked, and the layer's own cache-write run on a scratch block (`check_cpu_mla_layout`).
`group_order`: vLLM's groups in kvbridge's order (by first layer) with their block sizes.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import IncompatibleEngines
from kvbridge.integrations.vllm.layout import VllmCpuLayout, vllm_conv_rows, vllm_cpu_layout, vllm_cpu_spec
from kvbridge.pool.background import one_line

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def group_order(kv_cache_config: KVCacheConfig, default_block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """vLLM's KV-cache group indices ordered by their first layer (kvbridge's group order), and
    each vLLM group's block size."""
    from vllm.model_executor.models.utils import extract_layer_index

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return (0,), (default_block,)
    first = [min((extract_layer_index(n) for n in g.layer_names), default=0) for g in groups]
    sizes = tuple(int(getattr(g.kv_cache_spec, "block_size", default_block)) for g in groups)
    return tuple(sorted(range(len(groups)), key=first.__getitem__)), sizes


def sliding_window_of(kv_spec: object) -> int | None:
    """The window of a vLLM group that slides (`SlidingWindowSpec`); None for full attention, also
    for sliding layers vLLM promoted to full (a `FullAttentionSpec` carrying `sliding_window`, the
    hybrid allocator off), whose blocks vLLM keeps whole."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return int(kv_spec.sliding_window) if isinstance(kv_spec, SlidingWindowSpec) else None


def pd_window_note(kv_cache_config: KVCacheConfig) -> str:
    """One line for the P/D connector's log when every layer slides (one group of vLLM's
    `SlidingWindowSpec`), '' otherwise. The P/D connector describes such a group as full
    attention and moves every prompt token's K/V, of which vLLM reads only the window: correct
    (the decode side's out-of-window blocks are written, never read, and freed the step after the
    load), more bytes than needed for prompts past the window. Describing it as sliding, as the
    pool does, changes the P/D geometry and wants an every-layer-sliding P/D pair through real
    vLLM to test it, which has not been run; until then this says so."""
    groups = kv_cache_config.kv_cache_groups
    window = sliding_window_of(groups[0].kv_cache_spec) if len(groups) == 1 else None
    if window is None:
        return ""
    return (f"every layer slides (window {window} tokens): this connector moves every prompt token's K/V (it "
            f"describes the group as full attention), of which vLLM reads only the last {window}; correct, more "
            "bytes than needed for prompts past the window (the pool connector moves only the window)")


def spec_and_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor],
                    tp_size: int, prefix_states: bool = False) -> tuple[ModelSpec, VllmCpuLayout, list[str]]:
    """kvbridge's description of this rank's vLLM CPU cache, and the layer names in layer order.

    `prefix_states`: the caller reads blocks per prefix (the pool): recurrent state as vLLM's
    `align` mode keeps it (a state block is a checkpoint at a block boundary; otherwise that mode
    is refused), and a model whose every layer slides (one group of vLLM's `SlidingWindowSpec`)
    as sliding layers, since vLLM frees the blocks its window left (the P/D connector moves every
    block of a request it has just prefilled and describes them as full)."""
    from vllm.model_executor.models.utils import extract_layer_index

    mc = vllm_config.model_config
    if mc.use_mla:
        return _mla_spec_and_layout(vllm_config, kv_cache_config, kv_caches, tp_size)
    layout_name = str(getattr(vllm_config.cache_config.get_resolved_kv_cache_layout(), "name", ""))
    if layout_name and layout_name != "LBHNC":
        raise IncompatibleEngines(f"KVBridgeConnector describes vLLM CPU's LBHNC cache; this engine uses {layout_name}")
    if len(kv_cache_config.kv_cache_groups) > 1 or kv_cache_config.has_mamba_layers:
        return _hybrid_spec_and_layout(vllm_config, kv_cache_config, kv_caches, tp_size, prefix_states)
    names = sorted(kv_caches, key=extract_layer_index)
    if [extract_layer_index(n) for n in names] != list(range(len(names))):
        raise IncompatibleEngines(f"KV cache layers are not 0..n-1: {names}")
    total_heads = mc.get_total_num_kv_heads()
    head = mc.get_head_size()
    first = kv_caches[names[0]]
    window = sliding_window_of(kv_cache_config.kv_cache_groups[0].kv_cache_spec) if prefix_states else None
    layers = []
    for name in names:
        t = kv_caches[name]
        if t.dim() != 4 or t.shape[3] != 2 * head or t.dtype != first.dtype or t.shape != first.shape:
            raise IncompatibleEngines(
                f"layer {name}: expected vLLM CPU cache [blocks, kv heads, block tokens, 2 x {head}] like the first "
                f"layer {tuple(first.shape)} {first.dtype}, got {tuple(t.shape)} {t.dtype}")
        layers.append(LayerSpec("sliding", total_heads, head, head, window=window) if window else
                      LayerSpec("full", total_heads, head, head))
    spec = vllm_cpu_spec(ModelSpec(tuple(layers), normalize_dtype(str(first.dtype)), str(mc.model)))
    num_blocks = int(kv_cache_config.num_blocks)
    block_size = int(vllm_config.cache_config.block_size)
    nkb, local_heads, kbs, _ = first.shape
    if nkb * kbs != num_blocks * block_size:
        raise IncompatibleEngines(f"cache holds {nkb} kernel blocks of {kbs} tokens, the manager {num_blocks} blocks "
                                  f"of {block_size}")
    if local_heads != max(1, total_heads // tp_size):
        raise IncompatibleEngines(f"cache has {local_heads} KV heads per rank; {total_heads} over TP {tp_size} "
                                  f"gives {max(1, total_heads // tp_size)}")
    return spec, vllm_cpu_layout(tp_size, block_size, num_blocks, kbs), names


def _mla_spec_and_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor],
                         tp_size: int) -> tuple[ModelSpec, VllmCpuLayout, list[str]]:
    """MLA layers in one KV-cache group: the latent geometry from the model's config through
    transformers (kv_lora_rank + rope dims), each registered tensor `[kernel blocks, kernel block
    tokens, latent]` of the whole latent on every rank, and the layers' own cache-write checked
    (`check_cpu_mla_layout`). Sliding or compressed MLA (DeepSeek-V4) is refused."""
    from vllm.model_executor.models.utils import extract_layer_index

    from kvbridge.models.config import spec_from_hf_config

    mc = vllm_config.model_config
    if len(kv_cache_config.kv_cache_groups) != 1 or kv_cache_config.has_mamba_layers:
        raise IncompatibleEngines(f"an MLA model in {len(kv_cache_config.kv_cache_groups)} KV-cache groups; the vLLM "
                                  f"CPU connectors describe MLA in one group of full attention only")
    names = sorted(kv_caches, key=extract_layer_index)
    first = kv_caches[names[0]]
    spec = spec_from_hf_config(mc.hf_config.to_dict(), dtype=normalize_dtype(str(first.dtype)), view="engine",
                               warn=False)
    held = [i for i, layer in enumerate(spec.layers) if not layer.is_stateless]
    if [extract_layer_index(n) for n in names] != held:
        raise IncompatibleEngines(f"vLLM caches layers {[extract_layer_index(n) for n in names]}; the model's config "
                                  f"gives a latent to {held}")
    odd = sorted({f"{layer.kind} (window {layer.window}, {layer.tokens_per_row} tokens per row)"
                  for i, layer in enumerate(spec.layers) if i in held
                  and (layer.kind != "mla" or layer.window is not None or layer.tokens_per_row != 1)})
    if odd:
        raise IncompatibleEngines(f"an MLA model whose layers are also {', '.join(odd)}; the vLLM CPU connectors "
                                  f"describe plain MLA layers only")
    spec = vllm_cpu_spec(ModelSpec(spec.layers, spec.dtype, str(mc.model)))
    latent = spec.layers[held[0]].key_dim
    num_blocks, block_size = int(kv_cache_config.num_blocks), int(vllm_config.cache_config.block_size)
    for name in names:
        t = kv_caches[name]
        rows = t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t  # vLLM 0.32 registers [blocks, 1, block, latent]
        if (rows.dim() != 3 or t.shape != first.shape or t.dtype != first.dtype or rows.shape[2] != latent
                or rows.shape[0] * rows.shape[1] != num_blocks * block_size or not t.is_contiguous()):
            raise IncompatibleEngines(
                f"layer {name}: expected vLLM CPU's MLA cache [blocks, (1,) block tokens, {latent}] of {num_blocks} "
                f"blocks of {block_size} tokens like the first layer {tuple(first.shape)} {first.dtype}, got "
                f"{tuple(t.shape)} {t.dtype}")
    return spec, vllm_cpu_layout(tp_size, block_size, num_blocks, int(first.shape[-2])), names


def check_cpu_mla_layout(vllm_config: VllmConfig, layer_name: str, cache: torch.Tensor) -> str:
    """Run the MLA layer's own cache-write (its backend's `do_kv_cache_update`) on a scratch
    cache and check that a token's latent (kv_lora_rank values, then the rope part) lands as one
    row at its slot and nothing else is written; returns the backend's class name. Refuses (naming
    it) a backend that places the bytes otherwise."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    impl = getattr(layer, "impl", None)
    rank, rope = getattr(impl, "kv_lora_rank", None), getattr(impl, "qk_rope_head_dim", None)
    if impl is None or not isinstance(rank, int) or not isinstance(rope, int):
        raise IncompatibleEngines(f"layer {layer_name}: no MLA attention implementation with kv_lora_rank and "
                                  f"qk_rope_head_dim to check vLLM's cache-write against")
    name, dtype, kbs, n = type(impl).__name__, cache.dtype, int(cache.shape[-2]), 5
    if int(cache.shape[-1]) != rank + rope:
        raise IncompatibleEngines(f"layer {layer_name}: a latent row of {int(cache.shape[-1])} values, but "
                                  f"kv_lora_rank {rank} + rope {rope}")
    scratch = torch.zeros(3, kbs, rank + rope, dtype=dtype)  # the registered [blocks, 1, block, latent]'s bytes
    kv_c = (torch.arange(n * rank, dtype=torch.float32) % 251 + 1).to(dtype).view(n, rank)
    k_pe = -(torch.arange(n * rope, dtype=torch.float32) % 241 + 1).to(dtype).view(n, 1, rope)
    slots = torch.tensor([1, kbs - 1, kbs + 3, 2 * kbs, 3 * kbs - 1], dtype=torch.int64)
    impl.do_kv_cache_update(kv_c, k_pe, scratch, slots, "auto", torch.ones(1, dtype=torch.float32))
    want = torch.zeros(3 * kbs, rank + rope, dtype=dtype)
    want[slots] = torch.cat([kv_c, k_pe[:, 0]], dim=1)
    if not torch.equal(scratch.reshape(-1, rank + rope), want):
        raise IncompatibleEngines(f"vLLM's MLA backend {name} does not write a token's latent as one row at its slot "
                                  f"(kv_lora_rank values, then rope); kvbridge describes [blocks, block, latent]")
    return name


def hybrid_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, dtype: str,
                prefix_states: bool = False) -> ModelSpec:
    """The model as vLLM's hybrid allocator keeps it: the geometry from the config through
    transformers (`spec_from_hf_config`, vLLM's view: conv states of kernel - 1 values), the
    state dtype from vLLM's `MambaSpec`, conv rows in vLLM's order (`vllm_conv_rows`). From the
    configs alone, so the scheduler (no tensors) and each worker derive the same spec."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    from kvbridge.models.config import spec_from_hf_config

    mc = vllm_config.model_config
    states = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if hasattr(g.kv_cache_spec, "shapes")]
    modes = {str(getattr(s, "mamba_cache_mode", "none")) for s in states}
    if modes - {"none"} and not prefix_states:
        raise IncompatibleEngines(f"vLLM caches recurrent state per prefix (mamba_cache_mode {sorted(modes)}); "
                                  f"KVBridgeConnector moves one state per request: start vLLM without prefix caching")
    if prefix_states and modes - {"align"}:
        raise IncompatibleEngines(f"the pool reads recurrent state as vLLM's per-block checkpoints (mamba_cache_mode "
                                  f"align, on with --enable-prefix-caching); this vLLM keeps {sorted(modes)}")
    state_dtype = normalize_dtype(str(states[0].dtypes[-1])) if states else None
    spec = spec_from_hf_config(mc.hf_config.to_dict(), dtype=dtype, view="engine", state_dtype=state_dtype, warn=False)
    if spec.row_rates:
        raise IncompatibleEngines("the model keeps compressed rows (one per several tokens, DeepSeek-V4); "
                                  "KVBridgeConnector does not describe vLLM's pages of them yet")
    if str(get_conv_state_layout()) == "SD":
        spec = vllm_conv_rows(spec)
    return vllm_cpu_spec(ModelSpec(spec.layers, spec.dtype, str(mc.model)))


def _hybrid_spec_and_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                            kv_caches: dict[str, torch.Tensor], tp_size: int,
                            prefix_states: bool = False) -> tuple[ModelSpec, VllmCpuLayout, list[str]]:
    """Several KV-cache groups (vLLM's hybrid allocator): the spec from the configs
    (`hybrid_spec`), one block size per group; then every layer's tensor is checked against it
    (shape, bytes per block, unified page), so a vLLM whose layout differs is refused instead of
    misread."""
    from vllm.model_executor.models.utils import extract_layer_index

    mc = vllm_config.model_config
    by_index: dict[int, str] = {}
    for name in kv_caches:
        i = extract_layer_index(name)
        if i in by_index:
            raise IncompatibleEngines(f"layers {by_index[i]} and {name} share index {i}")
        by_index[i] = name
    attn = [kv_caches[n] for n in kv_caches if kv_caches[n].dtype != torch.int8]
    spec = hybrid_spec(vllm_config, kv_cache_config, normalize_dtype(str(attn[0].dtype if attn else mc.dtype)),
                       prefix_states)
    held = [i for i, layer in enumerate(spec.layers) if not layer.is_stateless]
    if sorted(by_index) != held:
        raise IncompatibleEngines(f"vLLM caches layers {sorted(by_index)}; the model's config gives state to {held}")
    names = [by_index[i] for i in held]
    # Each kvbridge group (layers of one kind) must be exactly one vLLM group.
    group_of = {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names}
    block_sizes = []
    for layers in spec.groups:
        vgroups = {group_of.get(by_index[i]) for i in layers}
        if len(vgroups) != 1 or None in vgroups or len(kv_cache_config.kv_cache_groups[vgroups.pop()].layer_names) \
                != len(layers):
            raise IncompatibleEngines(
                f"vLLM groups layers {layers} ({spec.layers[layers[0]].kind}) differently from kvbridge (one group per "
                f"layer kind); start vLLM with --disable-hybrid-kv-cache-manager")
        block_sizes.append(int(kv_cache_config.kv_cache_groups[group_of[by_index[layers[0]]]].kv_cache_spec.block_size))
    num_blocks = int(kv_cache_config.num_blocks)
    layout = VllmCpuLayout(tp_size=tp_size, block_size=int(vllm_config.cache_config.block_size), num_blocks=num_blocks,
                           group_block_sizes=tuple(block_sizes), kv_order="HND", kv_placement="blocks_first",
                           layer_placement="per_layer")
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    addr = layout.addressing(spec, get_tensor_model_parallel_rank())
    for li, name in zip(held, names):
        t, layer = kv_caches[name], spec.layers[li]
        g = spec.layer_group[li]
        nbytes = int(addr.heads[li, : addr.num_components[li]] @ addr.row_bytes[li, : addr.num_components[li]])
        want_blocks = num_blocks * (1 if layer.is_recurrent else layout.group_block_size(g) // layout.group_kernel_size(g))
        per_block = nbytes if layer.is_recurrent else nbytes * layout.group_kernel_size(g)
        stride = t.stride(0) * t.element_size()
        got = t[0].numel() * t.element_size() if t.dim() else 0
        if t.dim() != 4 or t.shape[0] != want_blocks or got != per_block or stride != int(addr.block_stride[li, 0]):
            raise IncompatibleEngines(
                f"layer {name} ({layer.kind}): vLLM's cache is {tuple(t.shape)} {t.dtype} with a block stride of "
                f"{stride} B; kvbridge expects {want_blocks} blocks of {per_block} B every "
                f"{int(addr.block_stride[li, 0])} B")
    return spec, layout, names


_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""vLLM's fp8 `--kv-cache-dtype` names and the torch dtype whose bytes its CPU kernels write."""


def _probe_cpu_kv(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto",
                  isa_dtype: torch.dtype | None = None) -> tuple[str, bool, str]:
    """vLLM's own CPU cache-write kernel on a scratch block of `dtype`, with the ISA vLLM's backend
    picks for a model of `isa_dtype` (default `dtype`): (ISA, whether K lands transposed and V by
    rows, as `VllmCpuLayerSpec` describes, and in words what it found)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(isa_dtype or dtype, block_size, head_size, kv_cache_dtype)
    n, d = block_size, head_size
    kv = torch.zeros(1, 1, n, 2 * d, dtype=dtype)
    key_cache, value_cache = kv.view(1, 1, 2 * n, d).chunk(2, dim=2)
    key = (torch.arange(n * d, dtype=torch.float32) % 251 + 1).to(isa_dtype or dtype).view(n, 1, d)
    value = -(torch.arange(n * d, dtype=torch.float32) % 241 + 1).to(isa_dtype or dtype).view(n, 1, d)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(n, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    except (RuntimeError, TypeError, ValueError) as e:  # a kernel that takes no such scratch block: not shown
        return isa, False, f"nothing it would show ({one_line(e)[:120]})"
    # An fp8 cache (uint8 in vLLM) holds the fp8 encoding of K and V (scales of 1 here), not an
    # integer cast of them: compared as bytes with that encoding (before, with the cast, which can
    # never match, so every fp8 kernel was said to keep "an unknown order").
    fp8 = _FP8.get(kv_cache_dtype) if torch.empty((), dtype=dtype).element_size() == 1 else None
    if fp8 is not None:
        raw = kv.view(torch.uint8).view(2 * n, d)
        key, value = (t.to(getattr(torch, fp8)).view(torch.uint8) for t in (key, value))
    else:
        raw, key, value = kv.view(2 * n, d), key.to(dtype), value.to(dtype)
    k_ok = torch.equal(raw[:n].reshape(d, n), key[:, 0, :].t())
    v_ok = torch.equal(raw[n:], value[:, 0, :])
    rows = torch.equal(raw[:n], key[:, 0, :])
    found = (f"K {'transposed' if k_ok else 'by rows' if rows else 'in an unknown order'} and V "
             f"{'by rows' if v_ok else 'in an unknown order'}" + (f" ({fp8} bytes)" if fp8 else ""))
    return isa, k_ok and v_ok, found


def check_cpu_kv_layout(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """Run vLLM's own CPU cache-write kernel on a scratch block and check that it stores K
    transposed and V by rows, as `VllmCpuLayerSpec` describes; returns the ISA name. Refuses
    (naming the ISA and what it found) a kernel that places the bytes otherwise."""
    isa, ok, found = _probe_cpu_kv(dtype, block_size, head_size, kv_cache_dtype)
    if not ok:
        raise IncompatibleEngines(
            f"vLLM CPU attention ISA {isa!r} ({dtype}, block {block_size}, head {head_size}) stores {found}; "
            f"kvbridge describes K transposed, V by rows (the 'vec' kernels)")
    return isa


def cpu_byte_order(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The pool's `byte_order` for this engine: empty where every attention group's blocks hold
    their bytes as `VllmCpuLayout` describes, else each differing group's kernel, block and head
    size (vLLM CPU's AMX kernels for bfloat16 in blocks of 32 or more).

    Why not refuse: between engines of one kernel, block and head size, store and load apply one
    misdescription and its inverse, so the bytes land where they came from (measured: tokens and
    log-probs equal). Why not describe it: AMX packs K by pairs of dimensions per 16-token tile and
    V by pairs of tokens per 16-dimension tile, and that V tiling spans the whole block, so its byte
    order changes with the block size. The namespace keeps engines of other orders apart: a miss
    where a load would have been wrong. Checked on vLLM's own kernel, as `check_cpu_kv_layout`."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or vllm_config.model_config.use_mla:  # MLA: `check_cpu_mla_layout`
        return ""
    cache_dtype = vllm_config.cache_config.cache_dtype
    kernels = {(kv.dtype, int(kv.block_size), int(kv.head_size)) for kv in (g.kv_cache_spec for g in
               kv_cache_config.kv_cache_groups) if hasattr(kv, "head_size") and not hasattr(kv, "shapes")}
    orders = set()
    for dtype, block, head in kernels:  # one probe per kernel (full and sliding groups often share one)
        isa, ok, _ = _probe_cpu_kv(dtype, block, head, cache_dtype, vllm_config.model_config.dtype)
        if not ok:
            orders.add(f"vllm-cpu {isa} block {block} head {head}")
    order = ", ".join(sorted(orders))
    if len(order) > 120:  # many groups: a digest keeps `PoolConfig.byte_order` bounded, as exact a separator
        order = f"vllm-cpu orders {hashlib.sha256(order.encode()).hexdigest()[:32]}"
    return order


__all__ = ["check_cpu_kv_layout", "check_cpu_mla_layout", "cpu_byte_order", "group_order", "pd_window_note",
           "sliding_window_of",
           "spec_and_layout"]
