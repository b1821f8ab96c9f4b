// Links the one-header translation units together: a header that defines a function or a
// variable that is not inline fails the link with a multiple definition.
int main() {
    return 0;
}
