"""What names a GPU outside torch: its UUID and PCI bus id, for libraries that count
physical devices (NVML, pymtml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import selection
from .selection import DeviceLike


@dataclass(frozen=True)
class PhysicalIdentity:
    """What names a GPU outside torch, for libraries that count physical devices (NVML,
    pymtml): torch's index differs from theirs under ``CUDA_VISIBLE_DEVICES`` /
    ``MUSA_VISIBLE_DEVICES`` and under CUDA's default fastest-first order."""

    uuid: Optional[str]  # 32 lowercase hex digits, no dashes or vendor prefix
    pci_bus_id: Optional[str]  # "DDDDDDDD:BB:DD.0", as NVML formats busId


def normalized_uuid(text: str) -> Optional[str]:
    """The 32 hex digits of a UUID as torch ("6f7b...-...") or NVML ("GPU-6f7b...-...")
    writes it, lowercase (the vendor prefixes hold no hex digit); None when ``text``
    holds no UUID."""
    digits = "".join(ch for ch in text.lower() if ch in "0123456789abcdef")
    return digits if len(digits) == 32 else None


def physical_identity(device: DeviceLike = None) -> PhysicalIdentity:
    """The GPU's UUID and PCI bus id, from ``get_device_properties`` where the torch
    build reports them (CUDA: ``uuid``; PCI fields where present)."""
    dev = selection.resolve(device)
    if not selection.is_gpu(dev):
        raise ValueError(f"physical_identity: device must be a GPU, got {dev}")
    props = selection.device_module(dev).get_device_properties(dev)
    uuid = getattr(props, "uuid", None)
    bus = getattr(props, "pci_bus_id", None)
    pci = None
    if isinstance(bus, int):
        pci = (f"{int(getattr(props, 'pci_domain_id', 0) or 0):08x}:{bus:02x}:"
               f"{int(getattr(props, 'pci_device_id', 0) or 0):02x}.0").upper()
    return PhysicalIdentity(normalized_uuid(str(uuid)) if uuid is not None else None, pci)
