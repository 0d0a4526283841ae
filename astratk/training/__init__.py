"""Trainer side: Lightning module, data module, weight-publish callback, aggregation."""
