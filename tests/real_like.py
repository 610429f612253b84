"""The real-like test models live in te_lab.models.real_like (the fuse-time benchmark uses them too)."""

from te_lab.models.real_like import largest_activation, make_real_like  # noqa: F401
