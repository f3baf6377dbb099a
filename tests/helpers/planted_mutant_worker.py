"""Preloaded by a worker pool (``preload=``): the worker knows the planted bug of
`tests.helpers.planted_mutant`."""

from tests.helpers.planted_mutant import register

register()
