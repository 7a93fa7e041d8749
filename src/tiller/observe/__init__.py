"""Observe: metrics (JSONL, TensorBoard, W&B), progress bars and evaluation statistics."""
