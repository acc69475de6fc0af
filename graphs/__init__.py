"""closedloop.graphs"""
