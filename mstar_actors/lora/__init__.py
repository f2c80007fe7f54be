"""LoRA adapters: files (read, validate, digest), the slot table, delta ops.

- ``adapter_file.read_adapter``: a PEFT folder -> validated CPU factors + digest.
- ``base_shapes.BaseShapes``: the base model's targetable modules.
- ``slot_table.SlotTable``: which adapter sits in which device slot (pure).
- ``ops``: segments, the torch reference, ``LoraStack`` (one per targeted
  linear; ``add_delta`` is the one call a linear makes); ``triton_ops`` the
  CUDA kernels behind it.
"""

from mstar_actors.lora.adapter_file import AdapterError, AdapterWeights, LoraModule, read_adapter
from mstar_actors.lora.base_shapes import BaseShapes
from mstar_actors.lora.ops import LoraSegments, LoraStack, build_segments, lora_delta_ref
from mstar_actors.lora.slot_table import ZERO_SLOT, SlotInstall, SlotSettled, SlotState, SlotTable

__all__ = [
    "AdapterError",
    "AdapterWeights",
    "BaseShapes",
    "LoraModule",
    "LoraSegments",
    "LoraStack",
    "SlotInstall",
    "SlotSettled",
    "SlotState",
    "SlotTable",
    "ZERO_SLOT",
    "build_segments",
    "lora_delta_ref",
    "read_adapter",
]
