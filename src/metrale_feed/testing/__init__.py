"""What tests and demos check a feed against: the paged-KV reference model, its fed-step graphs and
the exact numpy oracle of the argmax rule. It ships in the wheel, so a scheduler's own tests can use
it as their model double."""
