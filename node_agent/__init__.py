"""The macpool node agent: honest capacity, a hard local cap, heartbeats, llama-server supervision."""
