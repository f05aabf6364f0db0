"""Checks around a run: the interconnect doctor and the train-vs-deploy logit consistency check."""
