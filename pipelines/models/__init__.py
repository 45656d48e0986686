"""Model folders made from other formats (`groupforge model ...`)."""
