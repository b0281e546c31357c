"""Codecs: pure tensor math, no state. One module per algorithm family."""
