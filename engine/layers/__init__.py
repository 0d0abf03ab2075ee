"""Layers shared by model families: plain single-device math over packed token rows."""
