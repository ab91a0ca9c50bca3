"""The ``metrale-feed`` command and what it runs: the demo, the bench and the timeline."""
