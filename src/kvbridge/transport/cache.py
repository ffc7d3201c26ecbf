"""One rank's paged cache as torch tensors: the engines' view of the memory a layout describes.

The core (`kvbridge.core.layout`) says where every row lives as byte offsets; this module holds the
tensors those offsets point into, so the core stays free of torch and every engine (transports,
connector, offload) and the proofs share one typed handle on a rank's memory.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import IncompatibleEngines

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8, "int8": torch.int8,
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class RankCache:
    """The paged KV cache of one rank: its regions as flat torch tensors plus their addressing."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, rank: int, regions: list[torch.Tensor]):
        self.spec, self.layout, self.rank = layout.engine_spec(spec), layout, rank  # the KV dtype it stores
        self.addr = layout.addressing(spec, rank)
        if len(regions) != len(self.addr.region_nbytes):
            raise IncompatibleEngines(f"layout needs {len(self.addr.region_nbytes)} regions, got {len(regions)}")
        for i, (t, need) in enumerate(zip(regions, self.addr.region_nbytes)):
            have = t.numel() * t.element_size()
            if have != need or not t.is_contiguous():
                raise IncompatibleEngines(
                    f"region {i} of rank {rank} must be a contiguous tensor of {need} bytes, got {have} bytes"
                    f"{'' if t.is_contiguous() else ' (not contiguous)'}")
        self.regions = [t.reshape(-1) for t in regions]

    @classmethod
    def allocate(cls, spec: ModelSpec, layout: EngineLayout, rank: int, device: str | torch.device = "cpu",
                 fill: float | None = 0.0) -> RankCache:
        spec = layout.engine_spec(spec)
        dtype = TORCH_DTYPES[spec.dtype]
        nbytes = layout.addressing(spec, rank).region_nbytes
        regions = [torch.empty(n // spec.itemsize, dtype=dtype, device=device) for n in nbytes]
        if fill is not None:
            for r in regions:
                r.view(_INT_OF_SIZE[spec.itemsize]).fill_(0) if fill == 0 else r.fill_(fill)
        return cls(spec, layout, rank, regions)

    @classmethod
    def allocate_engine(cls, spec: ModelSpec, layout: EngineLayout, device: str | torch.device = "cpu",
                        fill: float | None = 0.0) -> list[RankCache]:
        return [cls.allocate(spec, layout, r, device, fill) for r in range(layout.world_size)]

    @property
    def nbytes(self) -> int:
        return sum(self.addr.region_nbytes)

    def byte_regions(self) -> list[torch.Tensor]:
        return [r.view(torch.uint8) for r in self.regions]

    def logical_view(self, layer: int, comp: int, as_int: bool = False) -> torch.Tensor:
        """View `[kernel_block, token, local_head, dim]` of one component of one layer.

        Recurrent state: `[slot, 1, local_unit, dim]`. `as_int` views the bits as a same-size
        integer type, for exact pattern fills.
        """
        a, spec = self.addr, self.spec
        if comp >= a.num_components[layer]:
            raise IndexError(f"layer {layer} has {a.num_components[layer]} components, not {comp + 1}")
        if int(a.region[layer, comp]) < 0:  # another PP stage's layer: no bytes here (region -1 would index the last)
            raise IndexError(f"layer {layer} is not held by this rank ({self.layout.describe()}, rank {self.rank})")
        component = spec.layers[layer].components[comp]
        isz = spec.component_itemsize(component)
        dtype = _INT_OF_SIZE[isz] if as_int else TORCH_DTYPES[spec.component_dtype(component)]
        region = self.regions[int(a.region[layer, comp])].view(torch.uint8).view(dtype)
        if spec.layers[layer].is_recurrent:
            blocks, tokens = self.layout.num_blocks, 1
        else:
            g, rows = spec.layer_group[layer], self.layout.row_layout(spec)  # rows per block for a rate layer
            blocks, tokens = rows.group_num_kernel_blocks(g), rows.group_kernel_size(g)
        size = (blocks, tokens, int(a.heads[layer, comp]), int(a.row_bytes[layer, comp]) // isz)
        stride = (int(a.block_stride[layer, comp]) // isz, int(a.token_stride[layer, comp]) // isz,
                  int(a.head_stride[layer, comp]) // isz, 1)
        # as_strided counts its offset from the start of the storage, not of the view: a region that
        # is a slice of a larger buffer must add where it starts.
        return torch.as_strided(region, size, stride, region.storage_offset() + int(a.base[layer, comp]) // isz)

    def read_state(self, layer: int, comp: int, slot: int, as_int: bool = False) -> torch.Tensor:
        """Recurrent state of one request slot: `[local_units, dim]`."""
        return self.logical_view(layer, comp, as_int)[slot, 0]

    def write_state(self, layer: int, comp: int, slot: int, values: torch.Tensor) -> None:
        view = self.logical_view(layer, comp, as_int=values.dtype in _INT_OF_SIZE.values())
        view[slot, 0] = values.to(view.device)

    def read_tokens(self, layer: int, comp: int, block_ids: np.ndarray, positions: np.ndarray,
                    as_int: bool = False) -> torch.Tensor:
        """Rows of the given token positions (held by this rank's CP rank): `[tokens, local_heads, dim]`."""
        kb, off = self.layout.row_layout(self.spec).kernel_slots(block_ids, np.asarray(positions, dtype=np.int64),
                                                                 self.spec.layer_group[layer])
        view = self.logical_view(layer, comp, as_int)
        return view[torch.from_numpy(kb), torch.from_numpy(off)]

    def write_tokens(self, layer: int, comp: int, block_ids: np.ndarray, positions: np.ndarray,
                     values: torch.Tensor) -> None:
        kb, off = self.layout.row_layout(self.spec).kernel_slots(block_ids, np.asarray(positions, dtype=np.int64),
                                                                 self.spec.layer_group[layer])
        view = self.logical_view(layer, comp, as_int=values.dtype in _INT_OF_SIZE.values())
        view[torch.from_numpy(kb), torch.from_numpy(off)] = values.to(view.device)
