"""closedloop.trainers"""
