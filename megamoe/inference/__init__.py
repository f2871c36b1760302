"""Inference: pipeline-aware forward passes and generation."""
