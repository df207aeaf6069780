"""dapo-ray: the DAPO recipe (arXiv 2503.14476) on Ray Serve, Ray Data and Ray Train."""

__version__ = "0.1.0"
