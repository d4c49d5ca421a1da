"""Adapters that let other tools drive meshloom models."""
