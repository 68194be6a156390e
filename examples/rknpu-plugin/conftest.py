"""Lets the tests import the package from this checkout, before or without installing it."""
