"""The scheduler: the router that queues fed steps, the decode pipeline and its requests.

It is built on the model contract at the top of the package (``metrale_feed.trait``,
``metrale_feed.kv``) and knows nothing of how a model computes its logits.
"""
