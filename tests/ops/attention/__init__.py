"""Tests of attention over the caches (paged and linear) and of the log-sum-exp merge."""
