from pulsar.cli import main

main()
