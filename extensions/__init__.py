"""te_lab's IPython extension (importable as ``te_lab.extensions``)."""
