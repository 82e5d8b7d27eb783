"""draftflow.bench"""
