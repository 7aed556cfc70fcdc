"""The run monitor: a consumer of the log that folds it into the series people watch (series.py),
raises alerts (alerts.py), and shows them in a terminal or a web page and feeds the trackers."""
