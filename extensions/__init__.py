"""te_lab's IPython extension (importable as ``te_lab.extensions``): ``%load_ext te_lab``
registers the magics, ``%unload_ext te_lab`` removes them."""

from __future__ import annotations

MAGIC_NAMES = {"line": ("te_fuse", "te_unfuse", "te_profile", "te_opportunities", "te_status"), "cell": ("te_profile",)}


def load_ipython_extension(shell) -> None:
    from .magics import TeLabMagics  # IPython is imported only here, never by `import te_lab`

    shell.register_magics(TeLabMagics)


def unload_ipython_extension(shell) -> None:
    # IPython has no "unregister": drop the names from its tables. No event hooks were added.
    for kind, names in MAGIC_NAMES.items():
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    shell.magics_manager.registry.pop("TeLabMagics", None)
