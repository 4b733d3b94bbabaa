"""Rollout as a service: tasks expand into sessions, gateway nodes run them in staged pools, results are
durable and delivered to trainers."""
