// On a recipe page the quoted code is the point: its "Source code in FILE" blocks start unfolded.
// The API reference keeps them folded.
if (window.location.pathname.includes("/recipes/")) {
  document.querySelectorAll("details.mkdocstrings-source").forEach((details) => {
    details.open = true;
  });
}
