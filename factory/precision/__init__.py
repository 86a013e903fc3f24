"""Precision policies: which number format each linear computes in."""
