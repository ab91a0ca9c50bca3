"""Tensor parallelism: a vocabulary split over ranks (``VocabShard``) and the rounds its filtered
sampling runs between collectives."""
