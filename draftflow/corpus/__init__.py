"""draftflow.corpus"""
