"""One pool of devices for an elastic training run and a serving app: the arbiter lends training's
workers to serving when its SLO is breached and takes them back when load falls (`shardyard pool`)."""
