"""te_lab's version (``te_lab.__version__``), in a module of its own so that what reports
it (``te_lab.status``) need not import the package's top level."""

__version__ = "0.1.0"
