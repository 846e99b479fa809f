"""Services for the Streamlit app (pages/): the background job manager and the figures. Nothing in the
engine imports them, and they never call st.* themselves."""
