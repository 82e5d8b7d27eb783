"""draftflow.train"""
