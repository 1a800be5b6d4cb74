"""Distributed kernels: collectives and the ops that communicate inside (autograd-aware)."""
