"""Federated algorithms assembled from fedcore's parts (tensor groups, client mods, client state, server optimizers)."""
