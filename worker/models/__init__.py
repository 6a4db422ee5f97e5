"""Llama-family model code, weight loading and the embedded default model."""
