"""Harnesses that train under several layouts, or with interruptions, and compare the results with a reference:
the layout-vs-one-process parity harness and the resumed-vs-uninterrupted harness (tests and `meshloom parity`)."""
