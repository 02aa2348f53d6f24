"""The ``hyperjax`` command line."""
