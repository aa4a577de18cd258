"""Helpers the tests share: tiny random models, reference writers, live servers. Tests import only from here,
never from each other."""
