"""Quantization algorithms that rewrite the float graph or tune scales (SmoothQuant, EasyQuant ...)."""
