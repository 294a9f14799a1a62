"""``macpool autoscale``: the controller that acts on the pool's demand - standby Macs, Wake-on-LAN."""
